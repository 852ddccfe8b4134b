"""``kvscope explain``'s text: what each figure is, said so that it cannot be misread.

The answers are built as ``kvscope.explain.answer`` builds them (the JSON schema's
``preemption`` and ``holders``), with figures a prefix-cached pool produces: requests that
share their prompt's blocks, so their block tables sum to more than the pool holds."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from kvscope.explain import render_json, render_text

SCHEMA = render_json.schema()


def valid(body: Any, definition: str) -> Any:
    jsonschema.validate(json.loads(json.dumps(body)), {**SCHEMA, "$ref": f"#/$defs/{definition}"})
    return body


def holders(held: int = 79, requests: int = 6) -> dict[str, Any]:
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
                  "resumed": {"ts": 3.0, "step": 3597}, "holders": holders(), "layout": layout},
                 "preemption")


def test_the_blocks_held_are_said_to_be_table_entries_a_shared_block_counted_in_each() -> None:
    # 79 entries in a 64-block pool: prompts shared through the prefix cache (the demo's
    # retries). "pool held: 79 blocks" read as more blocks than the pool has.
    (line, *tops) = render_text._holders(holders(79, 6))
    assert line == ("    held as the step began: 79 blocks in 6 requests' block tables "
                    "(a block shared through the prefix cache counts in each table); top:")
    assert tops == ["      by request: cmpl-a 26, cmpl-b 24", "      by client: rag-service 71",
                    "      by user agent: rag/0.9 71"]


def test_the_evictable_cached_blocks_are_dated_by_their_layout_sample() -> None:
    lines = render_text._preemption(1, preemption(16, 3184))
    assert lines[1] == ("    requester cmpl-c needed 1 block; free 0, evictable cached ones "
                        "included (16 cached in the layout sample of step 3184); it lost "
                        "2 blocks and 38 computed tokens")


def test_no_layout_sample_is_said_so_not_printed_as_minus_one() -> None:
    lines = render_text._preemption(1, preemption(-1, None, needed=3))
    assert lines[1] == ("    requester cmpl-c needed 3 blocks; free 0, evictable cached ones "
                        "included (no layout sample at or before it to count them); it "
                        "lost 2 blocks and 38 computed tokens")
    assert "-1" not in "\n".join(lines)
