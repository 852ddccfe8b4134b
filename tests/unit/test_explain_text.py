"""``kvscope explain``'s text: what each figure is, said so that it cannot be misread.

The answers are built as ``kvscope.explain.answer`` builds them (the JSON schema's
``preemption``, ``holders`` and ``could_fit``), with figures a prefix-cached pool produces
(requests that share their prompt's blocks, so their block tables sum to more than the pool
holds) and a waiting request sized against the pool's usable blocks, hybrid layouts
included."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from kvscope.explain import holders, render_json, render_text

SCHEMA = render_json.schema()


def valid(body: Any, definition: str) -> Any:
    jsonschema.validate(json.loads(json.dumps(body)), {**SCHEMA, "$ref": f"#/$defs/{definition}"})
    return body


def holders_dict(held: int = 79, requests: int = 6) -> dict[str, Any]:
    ranked = [{"key": "cmpl-a", "blocks": 26}, {"key": "cmpl-b", "blocks": 24}]
    return valid({"held_blocks": held, "requests": requests, "by_request": ranked,
                  "by_client": [{"key": "rag-service", "blocks": 71}],
                  "by_user_agent": [{"key": "rag/0.9", "blocks": 71}]}, "holders")


def preemption(cached: int, layout_step: int | None, needed: int = 1) -> dict[str, Any]:
    layout = None if layout_step is None else {
        "ts": 1.0, "step": layout_step, "num_blocks": 64, "states": [0] * 64,
        "request_blocks": [3, 4]}
    return valid({"ts": 2.0, "step": 3581, "reason": "kv_full", "blocks_needed": needed,
                  "free_blocks": 0, "cached_evictable_blocks": cached, "victim_blocks": 2,
                  "tokens_lost": 38, "policy": "fcfs", "requester": "cmpl-c",
                  "requester_is_victim": False,
                  "trigger": {"event": "allocated", "step": 3581, "blocks": 1,
                              "total_blocks": 2},
                  "resumed": {"ts": 3.0, "step": 3597}, "holders": holders_dict(),
                  "layout": layout},
                 "preemption")


def test_the_blocks_held_are_said_to_be_table_entries_a_shared_block_counted_in_each() -> None:
    # 79 entries in a 64-block pool: prompts shared through the prefix cache (the demo's
    # retries). "pool held: 79 blocks" read as more blocks than the pool has.
    (line, *tops) = render_text._holders(holders_dict(79, 6))
    assert line == ("    held as the step began: 79 blocks in 6 requests' block tables "
                    "(a block shared through the prefix cache counts in each table); top:")
    assert tops == ["      by request: cmpl-a 26, cmpl-b 24", "      by client: rag-service 71",
                    "      by user agent: rag/0.9 71"]


def test_the_evictable_cached_blocks_are_dated_by_their_layout_sample() -> None:
    lines = render_text._preemption(1, preemption(16, 3184))
    assert lines[2] == "    trigger: allocated in that step, +1 block"
    assert lines[1] == ("    requester cmpl-c needed 1 block; free 0, evictable cached ones "
                        "included (16 cached in the layout sample of step 3184); it lost "
                        "2 blocks and 38 computed tokens")


def test_no_layout_sample_is_said_so_not_printed_as_minus_one() -> None:
    lines = render_text._preemption(1, preemption(-1, None, needed=3))
    assert lines[1] == ("    requester cmpl-c needed 3 blocks; free 0, evictable cached ones "
                        "included (no layout sample at or before it to count them); it "
                        "lost 2 blocks and 38 computed tokens")
    assert "-1" not in "\n".join(lines)


# -- whether a waiting request could ever fit the pool ------------------------------------
FULL = {"kv_group_kinds": ["FullAttentionSpec"], "kv_group_block_sizes": [16], "num_blocks": 64}
HYBRID = {"kv_group_kinds": ["SlidingWindowSpec", "FullAttentionSpec"],
          "kv_group_block_sizes": [16, 16], "num_blocks": 64}


def trace(tokens: int, config: dict[str, Any]) -> dict[str, Any]:
    """A trace's lengths and its ``required_blocks`` as the tracker writes it (every group)."""
    return {"prompt_len": tokens - 10, "output_len": 10,
            "required_blocks": sum(-(-tokens // bs) for bs in config["kv_group_block_sizes"])}


def test_a_request_fits_the_usable_blocks_not_the_null_block() -> None:
    # 64 blocks hold 63 usable (block 0 is vLLM's null block): 64 x 16 tokens never fit
    fit = valid(holders.could_fit(trace(64 * 16, FULL), FULL, [], "r", -1), "could_fit")
    assert fit == {"never_fits_decisions": 0, "required_blocks": 64,
                   "full_attention_blocks": 64, "pool_blocks": 64, "usable_blocks": 63,
                   "fits": False}
    assert holders.could_fit(trace(63 * 16, FULL), FULL, [], "r", -1)["fits"] is True


def test_a_hybrid_request_is_bounded_by_its_full_attention_blocks() -> None:
    # 40 blocks of sliding window and 40 of full attention: the sum (80) passes the 63
    # usable blocks, but the window's group holds only its window's blocks
    fit = holders.could_fit(trace(40 * 16, HYBRID), HYBRID, [], "r", -1)
    assert (fit["required_blocks"], fit["full_attention_blocks"], fit["fits"]) == (80, 40, True)
    named = [{"request_id": "r"}]  # the sidecar's never_fits decision is what it says
    assert holders.could_fit(trace(40 * 16, HYBRID), HYBRID, named, "r", -1)["fits"] is False


def test_without_the_engine_settings_nothing_is_claimed_beyond_what_is_known() -> None:
    # no engine_configs row: no group kinds, so no bound; the layout sample's pool size
    fit = holders.could_fit(trace(200 * 16, FULL), None, [], "r", 64)
    assert fit == {"never_fits_decisions": 0, "required_blocks": 200,
                   "full_attention_blocks": -1, "pool_blocks": 64, "usable_blocks": 63,
                   "fits": True}
    fit = holders.could_fit(None, None, [], "r", -1)
    assert (fit["required_blocks"], fit["pool_blocks"], fit["usable_blocks"]) == (-1, -1, -1)


def waiting(fit: dict[str, Any], reasons: dict[str, int] | None = None) -> dict[str, Any]:
    reasons = reasons or {}
    return valid({"step": 1910, "admission_blocked": sum(reasons.values()),
                  "admission_blocked_reasons": reasons, "holders": holders_dict(5, 1),
                  "could_fit": fit}, "waiting")


def test_the_waiting_line_says_which_limit_held_it() -> None:
    # what vLLM's waiting loop met first at each admission_blocked decision naming it
    fit = holders.could_fit(trace(5 * 16, FULL), FULL, [], "r", -1)
    line = render_text._waiting(waiting(fit, {"max_num_seqs": 3, "kv_blocks": 1}))[0]
    assert line.startswith("  while it waited (step 1910): 4 admission_blocked decisions name "
                           "it (kv_blocks 1, max_num_seqs 3); it could fit the pool ")


def test_the_waiting_line_says_which_blocks_were_compared() -> None:
    text = render_text._waiting(waiting(holders.could_fit(trace(5 * 16, FULL), FULL, [], "r",
                                                          -1)))
    assert text[0] == ("  while it waited (step 1910): 0 admission_blocked decisions name it; "
                       "it could fit the pool (5 blocks at its full length, of 63 usable)")
    text = render_text._waiting(waiting(holders.could_fit(trace(40 * 16, HYBRID), HYBRID, [],
                                                          "r", -1)))
    assert text[0].endswith("it could fit the pool (40 blocks of its full-attention groups "
                            "at its full length, of 63 usable; 80 in all groups, where "
                            "sliding-window and Mamba groups hold fewer)")
    text = render_text._waiting(waiting(holders.could_fit(trace(64 * 16, FULL), FULL, [], "r",
                                                          -1)))
    assert text[0].endswith("it could NEVER fit the pool (64 blocks at its full length, of "
                            "63 usable)")
    one = waiting(holders.could_fit(None, None, [], "r", -1), {"token_budget": 1})
    assert render_text._waiting(one)[0].startswith(
        "  while it waited (step 1910): 1 admission_blocked decision names it (token_budget "
        "1); ")
    text = render_text._waiting(waiting(holders.could_fit(None, None, [], "r", -1)))
    assert text[0].endswith("it could fit the pool as far as is known (no trace of it to "
                            "size it; no pool size stored)")
    # a layout sample's pool, no engine settings: the kinds of its groups are unknown
    text = render_text._waiting(waiting(holders.could_fit(trace(5 * 16, FULL), None, [], "r",
                                                          64)))
    assert text[0].endswith("it could fit the pool as far as is known (no engine settings "
                            "stored to tell its full-attention groups)")


def test_the_trace_line_says_its_blocks_count_every_group_whole() -> None:
    """A hybrid's trace: 60 blocks summed over its groups at the whole sequence, where its
    sliding-window groups held far fewer (24 at most in all). "60 blocks needed" read as
    what vLLM needed."""
    line = render_text._trace_line({"prompt_len": 900, "output_len": 60, "max_gen_len": 64,
                                    "required_blocks": 60, "allocated_blocks": 24,
                                    "finish_reason": "FINISHED_LENGTH_CAPPED",
                                    "client_id": ""})
    assert line == ("  prompt 900 tokens, output 60 of 64, 60 blocks at its full length in "
                    "all its KV cache groups (24 held at most), FINISHED_LENGTH_CAPPED, "
                    "client -")


def test_the_trace_line_of_a_request_whose_arrival_was_not_seen() -> None:
    """A sidecar that took the engine up mid-run stores -1 for the max_tokens it never
    heard: said as unknown, never as "of -1"."""
    line = render_text._trace_line({"prompt_len": 47, "output_len": 12, "max_gen_len": -1,
                                    "required_blocks": 4, "allocated_blocks": 4,
                                    "finish_reason": "FINISHED_STOPPED", "client_id": ""})
    assert line.startswith("  prompt 47 tokens, output 12 of ? (its arrival was not seen), ")


def test_the_trace_line_of_a_request_taken_up_before_its_table_was_heard() -> None:
    """A request that ended before a new sidecar heard its keyframe table holds -1 blocks:
    said as unknown."""
    line = render_text._trace_line({"prompt_len": 47, "output_len": 12, "max_gen_len": -1,
                                    "required_blocks": 4, "allocated_blocks": -1,
                                    "finish_reason": "FINISHED_STOPPED", "client_id": ""})
    assert "(? held at most)" in line and "-1" not in line
