"""vLLM's real scheduler: a full pool is "waiting for blocks", never "never fits".

On vLLM 0.32 a request that cannot fit in the whole pool cannot reach a started engine
(the server and the twin refuse such a pool; tests/engine/test_never_fits.py shows the
server's refusal), so these runs check the other side of the rule: no false "never fits",
on a full-attention pool that is merely full and on a hybrid pool where the probe's summed
upper bound exceeds the pool while the request fits.
"""

from __future__ import annotations

import pytest

from kvscope.rows import SchedulerDecision
from kvscope.state.capacity import head_fit
from kvscope.state.requests import RequestTracker
from kvscope.twin import TwinConfig
from kvscope.twin.probed import ProbedTwin
from kvscope.twin.workload import TwinRequest
from tests.twin.exactness import head_needs

pytestmark = pytest.mark.twin


def run(cfg: TwinConfig, requests: list[TwinRequest]) -> tuple[list[SchedulerDecision],
                                                               list[tuple[str, int, bool]]]:
    """Decisions, and (head, probe's bound, never_fits) after every step with a head."""
    pt = ProbedTwin(cfg, seed=3)
    decisions: list[SchedulerDecision] = []
    tracker = RequestTracker(
        lambda r: decisions.append(r) if isinstance(r, SchedulerDecision) else None)
    pt.hub.listeners.append(tracker.on_event)
    heads: list[tuple[str, int, bool]] = []

    def after(_: int, __: object) -> None:
        st = pt.state
        fit = head_fit(st.hello, st.last_step)
        if fit is not None:
            heads.append((fit.req_id, fit.blocks_needed, fit.never_fits))

    result = pt.run(requests, on_step=after)
    assert result.finished == len(requests)
    return decisions, heads


def req(rid: str, prompt: int, out: int, step: int = 0, token: int = 1) -> TwinRequest:
    """A prompt of one repeated token: distinct tokens, no shared prefix cache."""
    return TwinRequest(rid, (token,) * prompt, out, 0, step)


def test_a_full_pool_is_admission_blocked_not_never_fits() -> None:
    # 48 blocks (47 usable); each request needs 20 blocks for prompt + output, so two run
    # and the third waits for blocks to free up.
    requests = [req(f"r{i}", 600, 40, token=i + 1) for i in range(4)]
    decisions, heads = run(TwinConfig(num_blocks=48), requests)
    kinds = [d.decision for d in decisions]
    assert kinds.count("admission_blocked") >= 1
    assert "never_fits" not in kinds
    assert heads and not any(nf for _, _, nf in heads)
    blocked = [d for d in decisions if d.decision == "admission_blocked"]
    assert all(d.blocks_needed == 19 and d.blocks_needed > d.free_blocks for d in blocked)
    # a seat and the budget were free, nothing preempted: vLLM asked the pool
    assert {d.reason for d in blocked} == {"kv_blocks"}


def test_at_max_num_seqs_the_head_is_held_by_the_seats_before_the_pool() -> None:
    # the same pool and requests, two seats: vLLM's waiting loop breaks at max_num_seqs
    # running before it calls allocate_slots, though the head needs more blocks than are free
    requests = [req(f"r{i}", 600, 40, token=i + 1) for i in range(4)]
    decisions, _ = run(TwinConfig(num_blocks=48, max_num_seqs=2), requests)
    blocked = [d for d in decisions if d.decision == "admission_blocked"]
    assert blocked and all(d.blocks_needed > d.free_blocks for d in blocked)
    assert {d.reason for d in blocked} == {"max_num_seqs"}


def reasons_behind_a_long_prefill(seats: int) -> set[str]:
    """The admission_blocked reasons while a 1,400-token prompt is prefilled 32 tokens a
    step (the whole budget of every step) and its blocks fill the pool, a 900-token one
    waiting behind it."""
    cfg = TwinConfig(num_blocks=64, max_num_seqs=seats, max_num_batched_tokens=32,
                     max_model_len=1600)
    requests = [req("long", 1400, 8, token=1), req("next", 900, 8, step=1, token=2)]
    decisions, _ = run(cfg, requests)
    blocked = [d for d in decisions if d.decision == "admission_blocked"]
    assert blocked and all(d.blocks_needed > d.free_blocks for d in blocked)
    return {d.reason for d in blocked}


def test_with_the_budget_spent_the_head_is_held_by_the_budget_before_the_pool() -> None:
    # the waiting loop (while token_budget > 0) never runs
    assert reasons_behind_a_long_prefill(seats=4) == {"token_budget"}


def test_with_the_seats_full_and_the_budget_spent_the_budget_is_met_first() -> None:
    # one seat: both limits hold in every step, and vLLM's waiting loop tests its budget
    # (while token_budget > 0) before its seats (num_running >= max_num_active_reqs, inside
    # the loop): more seats would admit nothing
    assert reasons_behind_a_long_prefill(seats=1) == {"token_budget"}


def test_a_hybrid_head_over_the_summed_bound_still_fits_and_is_not_never_fits() -> None:
    # full+sliding over one pool of 44 blocks (43 usable; the fewest vLLM accepts for
    # max_model_len 1024 with a 32-token window and a 64-token budget). A 1000-token prompt:
    # the probe's bound sums the three groups vLLM builds (two sliding-window, one
    # full-attention), 3 * cdiv(1000, 32) = 96 > 43, but its
    # full-attention group needs 32 blocks and the sliding-window groups a few: vLLM admits
    # and finishes it.
    cfg = TwinConfig(num_blocks=44, layout="full+sliding", sliding_window=32,
                     max_num_batched_tokens=64)
    requests = [req("filler", 800, 20, token=1), req("long", 1000, 8, step=1, token=2)]
    decisions, heads = run(cfg, requests)
    assert ("long", 96, False) in heads  # over the pool by the sum, not by the rule
    assert "never_fits" not in [d.decision for d in decisions]


def test_the_heads_bound_holds_vllms_own_need_with_speculative_lookahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM admits a request with room for its speculative lookahead too (allocate_slots'
    num_lookahead_tokens): a 608-token prompt (19 blocks of 32) with 3 draft tokens needs
    20. With 19 blocks free beside a running one, vLLM's full-sequence check (19) passes
    and the lookahead's (20) fails; the probe's bound left the lookahead out and read 19,
    under vLLM's own need (its get_num_blocks_to_allocate, recorded at every call)."""
    cfg = TwinConfig(num_blocks=40, num_speculative_tokens=3, max_num_batched_tokens=2048)
    pt, checked, after = head_needs(monkeypatch, lambda: ProbedTwin(cfg, seed=3))
    requests = [req(f"r{i}", 608, 40, token=i + 1) for i in range(3)]
    assert pt.run(requests, on_step=after).finished == 3
    assert checked and all(bound >= need for bound, need in checked), checked
    assert (20, 20) in checked  # the lookahead's block is in vLLM's need and in the bound


def test_a_head_held_back_by_the_watermark_is_admission_blocked() -> None:
    """``--watermark 0.5``: vLLM keeps 24 of the 48 blocks from waiting requests while any
    request runs. r1 (19 blocks) fits the 27 free blocks beside r0, and vLLM still admits
    it only once r0 has ended: kvscope says it is blocked by the pool, the watermark's
    share named, and reads the reserve from vLLM's own manager."""
    cfg = TwinConfig(num_blocks=48, watermark=0.5)
    pt = ProbedTwin(cfg, seed=3)
    assert pt.rec.hello.watermark_blocks == 24
    assert pt.scheduler.kv_cache_manager.watermark_blocks == 24
    decisions, _ = run(cfg, [req("r0", 600, 40, token=1), req("r1", 600, 40, token=2)])
    blocked = [d for d in decisions if d.decision == "admission_blocked"]
    assert blocked and {d.request_id for d in blocked} == {"r1"}
    assert {d.reason for d in blocked} == {"kv_blocks"}
    assert all(d.blocks_needed <= d.free_blocks < d.blocks_needed + 24 for d in blocked)
    assert all("watermark_blocks=24" in d.msg for d in blocked)


def test_a_head_vllm_skips_for_its_grammar_is_not_called_blocked_by_blocks() -> None:
    """A structured-output request whose grammar is still compiling
    (``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``, as vLLM's add_request leaves it) sits at
    the head of the waiting queue and is skipped every step, vLLM admitting the requests
    behind it (``skip_request``: in ``deferred_waiting``, put back at the head). kvscope
    named it the head and sized its 1,000-token prompt against the free blocks: the
    admission alert's expression held while vLLM admitted the others."""
    from vllm.v1.request import RequestStatus

    pt = ProbedTwin(TwinConfig(num_blocks=40), seed=3)
    sched = pt.scheduler
    pt.twin.add(TwinRequest("grammar", (7,) * 1000, 20, 0, 0))
    sched.requests["grammar"].status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    for i in range(6):
        pt.twin.add(TwinRequest(f"r{i}", (i + 10,) * 300, 200, 0, 0))
    skipped_heads = admitted = 0
    for _ in range(40):
        out = pt.twin.step()
        pt.drain()
        admitted += len(out.scheduled_new_reqs) if out is not None else 0
        s = pt.state.last_step
        assert sched.requests["grammar"] in sched.deferred_waiting  # vLLM skips it
        assert s is not None and s.waiting >= 1
        skipped_heads += s.head_req_id == "grammar"
    assert admitted >= 2  # the requests behind it were admitted meanwhile
    assert skipped_heads == 0
