"""The "never fits" rule: a lower bound from the probe's summed upper bound, per KV group,
and how the sidecar reports it (decision log, gauge, /api/layout) within the step.

vLLM 0.32 refuses to start with a pool that cannot hold one max_model_len request (see
tests/engine/test_never_fits.py), so no real engine produces such a head; the records here
are the wire's own structs, as a newer vLLM or a changed pool would make the probe send.
"""

from __future__ import annotations

import msgspec

from kvscope.layout.api import engine_layout
from kvscope.layout.sampler import LayoutSampler
from kvscope.rows import SchedulerDecision
from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.state.capacity import admission_free, head_fit, min_blocks, min_tokens
from kvscope.state.hub import Hub
from kvscope.state.requests import RequestTracker
from kvscope_probe import wire
from tests.unit.test_wire import frame, hello, step

FULL = wire.KVGroup("FullAttentionSpec", 32)
SLIDING = wire.KVGroup("SlidingWindowSpec", 32)
MAMBA = wire.KVGroup("MambaSpec", 1024)


def test_min_tokens_is_the_shortest_sequence_with_that_many_blocks() -> None:
    assert min_tokens([FULL], 8) == 225
    assert min_tokens([SLIDING, SLIDING, FULL], 96) == 993
    assert min_tokens([FULL, MAMBA], 11) == 289  # cdiv(289, 32) + cdiv(289, 1024) = 10 + 1


def test_only_full_attention_groups_count_towards_never_fits() -> None:
    one = hello(num_blocks=8)  # 7 usable blocks, 224 tokens
    assert min_blocks(one, 7) == 7 and min_blocks(one, 8) == 8 and min_blocks(one, 0) == 0
    hybrid = hello(num_blocks=44, kv_groups=[SLIDING, SLIDING, FULL])
    assert min_blocks(hybrid, 96) == 32  # the 1000-token prompt of the twin test: fits
    assert min_blocks(hybrid, 3 * 44) == 44  # 1377..1408 tokens: 44 > 43 usable
    assert min_blocks(hello(kv_groups=[FULL, MAMBA]), 11) == 10
    assert min_blocks(hello(kv_groups=[]), 8) == 8  # no groups reported: one of block_size


def test_head_fit_needs_a_waiting_head() -> None:
    h = hello(num_blocks=8)
    assert head_fit(h, None) is None
    assert head_fit(h, step(waiting=0, head_blocks_needed=0)) is None
    fit = head_fit(h, step(waiting=2, head_blocks_needed=8, head_req_id="big"))
    assert fit is not None and fit.as_json() == {
        "req_id": "big", "blocks_needed": 8, "min_blocks": 8, "usable_blocks": 7,
        "never_fits": True, "admission_free": None}
    fit = head_fit(h, step(waiting=2, head_blocks_needed=7, head_req_id="ok"))
    assert fit is not None and not fit.never_fits


def test_the_watermark_holds_blocks_back_only_while_requests_run() -> None:
    """vLLM applies --watermark to a waiting request only when a request is scheduled
    (``allocate_slots``' ``has_scheduled_reqs``)."""
    h = msgspec.structs.replace(hello(), watermark_blocks=3)
    busy = head_fit(h, step(waiting=1, running=2, head_blocks_needed=4, head_req_id="w"), 6)
    idle = head_fit(h, step(waiting=1, running=0, head_blocks_needed=4, head_req_id="w"), 6)
    assert busy is not None and idle is not None
    assert (busy.admission_free, idle.admission_free) == (3, 6)
    assert admission_free(h, 6, 2) == 3 and admission_free(hello(), 6, 2) == 6


def feed(records: list[wire.Record]) -> tuple[Hub, list[SchedulerDecision]]:
    hub = Hub()
    decisions: list[SchedulerDecision] = []
    tracker = RequestTracker(
        lambda r: decisions.append(r) if isinstance(r, SchedulerDecision) else None)
    hub.listeners.append(tracker.on_event)
    for seq, rec in enumerate(records):
        assert hub.accept(wire.encode(frame([rec], first_seq=seq)))
    return hub, decisions


def gauge(hub: Hub, name: str) -> float:
    for fam in KVScopeCollector(hub).collect():
        if fam.name == name:
            return fam.samples[0].value
    raise AssertionError(f"{name} not exported")


def test_never_fits_is_reported_in_the_step_the_request_reaches_the_head() -> None:
    h = hello(num_blocks=8)
    big = step(ts=2.0, waiting=2, head_blocks_needed=9, head_req_id="big")
    hub, decisions = feed([h, step(ts=1.0), big])
    assert [(d.decision, d.request_id, d.blocks_needed) for d in decisions] == [
        ("never_fits", "big", 9)]
    assert decisions[0].ts == 2.0
    assert decisions[0].msg == (
        "Never fits: request big at the head of the waiting queue needs at least 9 blocks, "
        "more than the 7 usable blocks of the whole pool; it and the 1 requests behind it "
        "wait while it stays there")
    assert gauge(hub, "vllm_scheduler_waiting_head_never_fits") == 1


def test_never_fits_once_per_request_and_cleared_when_the_head_changes() -> None:
    h = hello(num_blocks=8)
    records = [h,
               step(ts=1.0, waiting=2, head_blocks_needed=9, head_req_id="big"),
               step(ts=2.0, waiting=2, head_blocks_needed=9, head_req_id="big"),
               step(ts=3.0, waiting=1, head_blocks_needed=3, head_req_id="small"),
               step(ts=4.0, waiting=1, head_blocks_needed=20, head_req_id="bigger")]
    hub, decisions = feed(records)
    assert [(d.decision, d.request_id) for d in decisions] == [
        ("never_fits", "big"), ("never_fits", "bigger")]
    assert gauge(hub, "vllm_scheduler_waiting_head_never_fits") == 1
    hub2, _ = feed(records[:4])
    assert gauge(hub2, "vllm_scheduler_waiting_head_never_fits") == 0


def test_the_layout_api_shows_the_waiting_head_and_whether_it_can_ever_fit() -> None:
    hub, _ = feed([hello(num_blocks=8),
                   step(ts=1.0, waiting=3, head_blocks_needed=12, head_req_id="big")])
    st = hub.engines["0"]
    out = engine_layout(st, LayoutSampler(hub), max_runs=10, history_points=5, now=2.0)
    assert out["waiting_head"] == {"req_id": "big", "blocks_needed": 12, "min_blocks": 12,
                                   "usable_blocks": 7, "never_fits": True,
                                   "admission_free": None}  # no keyframe: pool unknown
    hub, _ = feed([hello(num_blocks=8), step(ts=1.0)])
    out = engine_layout(hub.engines["0"], LayoutSampler(hub), 10, 5, 2.0)
    assert out["waiting_head"] is None


def test_the_per_step_shortcut_never_hides_a_head_that_never_fits() -> None:
    """Rollups skip the search while the upper bound + one block per group fits the usable
    blocks; that bound holds the lower bound for every head the search would judge."""
    for groups in ([FULL], [FULL, FULL], [SLIDING, SLIDING, FULL], [FULL, MAMBA],
                   [wire.KVGroup("FullAttentionSpec", 16), wire.KVGroup("FullAttentionSpec", 48)]):
        for num_blocks in (2, 3, 8, 44, 97):
            h = hello(num_blocks=num_blocks, kv_groups=groups)
            for need in range(0, 4 * num_blocks):
                lower = min_blocks(h, need)
                if need + len(groups) <= num_blocks:  # the shortcut says: it fits
                    assert lower <= num_blocks - 1, (groups, num_blocks, need)
