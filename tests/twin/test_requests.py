"""Layers 2 and 4 from a real scheduler run: traces, events, decisions and rollups."""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import pytest

from kvscope.decisions.log import DecisionLog
from kvscope.rows import (
    RequestAllocations,
    RequestEvent,
    RequestTrace,
    SchedulerDecision,
    StepStat,
    unrolled,
)
from kvscope.sinks.base import SinkManager
from kvscope.state.hub import Hub
from kvscope.state.requests import RequestTracker
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin

pytestmark = pytest.mark.twin


def run_tracked(n_requests: int = 80, seed: int = 5, on_step: Any = None,
                ) -> tuple[list[object], Hub, str, object]:
    """The tracker's rows of a preempting run; ``on_step(pt, out)`` after each step is
    ingested."""
    pt = ProbedTwin(TwinConfig(num_blocks=48), seed=seed)
    hub, rec = pt.hub, pt.rec
    rows: list[object] = []
    log = io.StringIO()
    sinks = SinkManager([DecisionLog(stream=log)])
    tracker = RequestTracker(lambda r: (rows.append(r), sinks.emit(r)))
    hub.listeners.append(tracker.on_event)

    result = pt.run(generate(WorkloadSpec(n_requests=n_requests, seed=seed)),
                    on_step=None if on_step is None else lambda _i, out: on_step(pt, out))
    assert not rec.ring and not rec.ends  # the engine's last step reports the last ends
    tracker.flush(hub.engines)
    sinks.close()  # the decision log writes on its own thread
    return rows, hub, log.getvalue(), result


def test_every_request_gets_a_trace_and_every_preemption_a_decision() -> None:
    rows, hub, log, result = run_tracked()
    st = hub.engines["0"]
    traces = [r for r in rows if isinstance(r, RequestTrace)]
    events = Counter(r.event for r in unrolled(rows) if isinstance(r, RequestEvent))
    decisions = [r for r in rows if isinstance(r, SchedulerDecision)]
    preempts = [d for d in decisions if d.decision == "preempt"]
    n_pre = sum(st.counters.preemptions.values())
    assert n_pre == result.preemptions > 0
    assert len(traces) == 80 == events["queued"]
    assert events["admitted"] == 80 and events["finished"] == 80
    assert events["preempted"] == n_pre == len(preempts)
    assert events["resumed"] == n_pre  # every victim came back and finished
    assert sum(t.preempt_count for t in traces) == n_pre
    assert all(t.finish_reason == "FINISHED_LENGTH_CAPPED" for t in traces)
    for t in traces:
        assert 0 <= t.queue_seconds <= t.first_token_seconds <= t.e2e_seconds
        assert t.allocated_blocks >= 1 and t.block_fragments >= 1
        assert t.contiguous_allocated == (t.block_fragments == 1)
        assert t.required_blocks == -(-(t.prompt_len + t.output_len) // 32)
        assert (t.preempt_count > 0) == (t.preempt_reason != "")
    assert sum(t.recomputed_tokens for t in traces) == st.counters.recomputed_tokens
    lines = [json.loads(ln) for ln in log.splitlines()]
    pre_lines = [ln for ln in lines if ln["event"] == "preempt"]
    assert len(pre_lines) == n_pre
    assert all(ln["msg"].startswith(f"Preempting request {ln['request_id']} due to kv_full")
               for ln in pre_lines)
    stats = [r for r in rows if isinstance(r, StepStat)]
    assert sum(s.steps for s in stats) == st.counters.steps
    assert sum(s.preemptions for s in stats) == n_pre


def test_first_token_is_the_step_vllm_scheduled_the_prompts_last_token() -> None:
    """A trace's time to first token ends at the step in which vLLM scheduled the last of
    its prompt's tokens (computed at scheduling plus scheduled reach the prompt), read
    from vLLM's own SchedulerOutput: the first such step, preemptions and resumes between."""
    prompts = {r.request_id: len(r.prompt_token_ids)
               for r in generate(WorkloadSpec(n_requests=80, seed=5))}
    first: dict[str, float] = {}

    def watch(pt: ProbedTwin, out: Any) -> None:
        c = out.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(zip(c.req_ids, c.num_computed_tokens, strict=True))
        for rid, n in out.num_scheduled_tokens.items():
            if rid not in first and computed[rid] + n >= prompts[rid]:
                first[rid] = pt.state.last_step.ts

    rows, _hub, _log, _ = run_tracked(on_step=watch)
    traces = {t.request_id: t for t in rows if isinstance(t, RequestTrace)}
    assert len(traces) == len(first) == 80
    for rid, t in traces.items():
        assert t.first_token_seconds == first[rid] - t.arrival_ts, rid


def test_lifecycle_events_carry_the_free_blocks_vllm_reported_at_their_step() -> None:
    """Queued, admitted, finished: each event's free blocks are the pool's free blocks as
    vLLM's own pool counted them in the step it came with (the probe's reading); -1 only
    in the first step, whose keyframe follows it."""
    free_at: dict[int, int] = {}

    def watch(pt: ProbedTwin, out: Any) -> None:
        free_at[pt.state.counters.steps] = pt.state.last_step.free_blocks

    rows, _hub, _log, _ = run_tracked(on_step=watch)
    events = [r for r in rows if isinstance(r, RequestEvent)
              and r.event in ("queued", "admitted", "finished")]
    assert Counter(e.event for e in events) == {"queued": 80, "admitted": 80, "finished": 80}
    assert len({e.free_blocks for e in events}) > 5
    for e in events:
        assert e.free_blocks == (-1 if e.step == 1 else free_at[e.step]), e


def test_allocations_chain_each_requests_table_from_admission_to_its_peak() -> None:
    """The allocations, written as arrays a run at a time, unroll into one event per
    allocation that continues the request's table: each adds its blocks to the blocks
    held after the event before it (admitted, resumed or allocated), in step order, and
    the most held is the trace's peak."""
    rows, _hub, _log, _result = run_tracked()
    allocs = [r for r in rows if isinstance(r, RequestAllocations)]
    assert allocs and any(len(a.step) > 1 for a in allocs)
    assert all(a.step == sorted(a.step) and min(a.offset_ms) == a.offset_ms[0] == 0
               for a in allocs)
    by: dict[str, list[RequestEvent]] = {}
    for e in unrolled(rows):
        if isinstance(e, RequestEvent):
            by.setdefault(e.request_id, []).append(e)
    checked = 0
    for t in (r for r in rows if isinstance(r, RequestTrace)):
        held = peak = 0
        for e in by[t.request_id]:
            if e.event in ("admitted", "resumed"):
                held = e.total_blocks
            elif e.event == "allocated":
                assert e.blocks > 0 and e.total_blocks == held + e.blocks, e
                held = e.total_blocks
                checked += 1
            elif e.event == "preempted":
                held = 0
            peak = max(peak, held)
        assert peak == t.allocated_blocks, t.request_id
    assert checked == sum(len(a.step) for a in allocs)


def test_no_prompt_token_reaches_any_row() -> None:
    rows, _hub, log, _ = run_tracked(n_requests=20, seed=9)
    text = repr(rows) + log
    assert "prompt_token_ids" not in text
    assert all(not hasattr(r, "prompt_token_ids") for r in rows)


def test_rows_no_sink_takes_are_not_built_and_traces_do_not_change() -> None:
    """With the store and decision log off (no sink takes events or decisions) the
    tracker builds none of them, and every trace and decision is the same as with them
    (per-second step rows are left out: their boundaries follow the wall clock)."""

    def run(wants: object) -> list[object]:
        pt = ProbedTwin(TwinConfig(num_blocks=48), seed=5)
        rows: list[object] = []
        tracker = RequestTracker(rows.append, wants=wants)  # type: ignore[arg-type]
        pt.hub.listeners.append(tracker.on_event)
        pt.run(generate(WorkloadSpec(n_requests=60, seed=5)))
        tracker.flush(pt.hub.engines)
        return rows

    everything = run(None)
    sinks = SinkManager([DecisionLog(stream=io.StringIO())])  # takes decisions only
    some = run(sinks.wants)
    sinks.close()
    kinds = Counter(type(r).__name__ for r in everything)
    assert kinds["RequestEvent"] > 0 and kinds["SchedulerDecision"] > 0
    assert kinds["RequestAllocations"] > 0
    assert not any(isinstance(r, (RequestEvent, RequestAllocations)) for r in some)
    keep = (RequestTrace, SchedulerDecision)
    # ts fields come from the clock, and a trace's max-contiguous at admission is sampled
    # at most MAXRUN_SAMPLE_S of wall time old: compare the rows without them
    def strip(rows: list[object]) -> list[tuple[str, tuple[object, ...]]]:
        return [(type(r).__name__, tuple(v for k, v in sorted(vars_of(r).items())
                                         if not k.endswith(("ts", "seconds"))
                                         and k != "max_contiguous_free_blocks_at_alloc"))
                for r in rows if isinstance(r, keep)]
    assert strip(some) == strip(everything)
    assert SinkManager([]).wants("request_events") is False


def vars_of(row: object) -> dict[str, object]:
    return {k: getattr(row, k) for k in row.__slots__}  # type: ignore[attr-defined]


def test_a_victims_blocks_are_the_ones_it_held_not_its_null_placeholders() -> None:
    """A sliding-window group's table keeps vLLM's null block in place of each block that
    left the window; the probe counted those as blocks the victim held (12 where it held
    8 in this run), and explain said it lost them. The truth is read from vLLM's own
    block IDs at each preemption."""
    pt = ProbedTwin(TwinConfig(num_blocks=80, layout="full+sliding", sliding_window=64),
                    seed=5)
    rows: list[object] = []
    tracker = RequestTracker(rows.append)
    pt.hub.listeners.append(tracker.on_event)
    rec = pt.rec
    null = rec.pool.null_block.block_id
    truth: list[tuple[int, int]] = []  # (table entries, blocks held) of each victim
    on_preempt = rec.on_preempt

    def seen(req: Any) -> None:
        ids = rec.mgr.get_block_ids(req.request_id)
        truth.append((sum(map(len, ids)), sum(b != null for g in ids for b in g)))
        on_preempt(req)

    rec.on_preempt = seen
    pt.run(generate(WorkloadSpec(n_requests=80, seed=5)))
    tracker.flush(pt.hub.engines)
    got = [e.blocks for e in rows if isinstance(e, RequestEvent) and e.event == "preempted"]
    assert got == [held for _, held in truth] and len(got) >= 2
    assert any(entries > held for entries, held in truth)  # a victim held placeholders


def test_a_prefix_cache_reset_preempts_before_the_step_that_resumes_its_victims() -> None:
    """vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts every running
    request outside ``schedule()``, and the next ``schedule()`` resumes them: one probe
    step record carries both. The tracker heard the step (the resume) before the
    preemption, so the resume recomputed 0 tokens and the preemption then set the
    running request's blocks to 0: its next allocations counted from there (1 where it
    held 41). Every row's blocks are vLLM's at that step, and the recomputed tokens the
    engine's."""
    pt = ProbedTwin(TwinConfig(num_blocks=400), seed=3)
    rows: list[object] = []
    tracker = RequestTracker(rows.append)
    pt.hub.listeners.append(tracker.on_event)
    mgr = pt.rec.mgr
    truth: dict[tuple[int, str], int] = {}  # (step, request): blocks vLLM gave it
    resets: list[int] = []

    def watch(i: int, out: Any) -> None:
        step = pt.state.counters.steps
        for rid in out.num_scheduled_tokens:
            truth[step, rid] = sum(map(len, mgr.get_block_ids(rid)))
        if i in (12, 40) and pt.scheduler.running:
            resets.append(len(pt.scheduler.running))
            assert pt.scheduler.reset_prefix_cache(reset_running_requests=True)

    pt.run(generate(WorkloadSpec(n_requests=30, seed=3, waves=1)), on_step=watch)
    tracker.flush(pt.hub.engines)
    st = pt.state
    n_pre = sum(st.counters.preemptions.values())
    assert len(resets) == 2 and n_pre == sum(resets) > 0
    events = [r for r in unrolled(rows) if isinstance(r, RequestEvent)]
    grown = [e for e in events if e.event in ("admitted", "resumed", "allocated")]
    assert [(e.step, e.request_id, e.total_blocks) for e in grown] == [
        (e.step, e.request_id, truth[e.step, e.request_id]) for e in grown]
    assert sum(e.event == "resumed" for e in events) == n_pre
    resumes = [d for d in rows if isinstance(d, SchedulerDecision) and d.decision == "resume"]
    assert len(resumes) == n_pre and all(d.tokens > 0 for d in resumes)
    traces = [r for r in rows if isinstance(r, RequestTrace)]
    assert sum(t.recomputed_tokens for t in traces) == st.counters.recomputed_tokens > 0


def test_blocks_a_sliding_window_gave_back_leave_the_requests_stored_holding() -> None:
    """vLLM lets go of a sliding-window group's blocks that left the window
    (remove_skipped_blocks) while the request runs on; the tracker counted them off but
    wrote a row only when the request grew, so the stored holding (the total blocks of a
    request's last event, what explain's holders read) kept blocks it had given back.
    After every step the stored holding of each running request is what vLLM's tables
    hold, and each allocation entry continues the one before it."""
    pt = ProbedTwin(TwinConfig(num_blocks=120, layout="full+sliding", sliding_window=64),
                    seed=5)
    rows: list[object] = []
    tracker = RequestTracker(rows.append)
    pt.hub.listeners.append(tracker.on_event)
    mgr, null = pt.rec.mgr, pt.rec.pool.null_block.block_id
    truth: dict[int, dict[str, int]] = {}  # step: blocks each running request held

    def watch(_i: int, _out: Any) -> None:
        truth[pt.state.counters.steps] = {
            r.request_id: sum(b != null for g in mgr.get_block_ids(r.request_id) for b in g)
            for r in pt.scheduler.running}

    pt.run(generate(WorkloadSpec(n_requests=40, seed=5)), on_step=watch)
    tracker.flush(pt.hub.engines)
    events = sorted((e for e in unrolled(rows) if isinstance(e, RequestEvent)),
                    key=lambda e: e.step)  # stable: the tracker's order within a step
    held: dict[str, int] = {}
    drops = 0
    at = 0
    for step in sorted(truth):
        while at < len(events) and events[at].step <= step:
            e = events[at]
            if e.event == "allocated":
                assert e.total_blocks == held[e.request_id] + e.blocks, e
                drops += e.blocks < 0
            held[e.request_id] = e.total_blocks if e.event in (
                "admitted", "resumed", "allocated") else 0
            at += 1
        assert {r: held[r] for r in truth[step]} == truth[step], step
    assert drops > 0


def test_a_sidecar_that_did_not_see_a_request_arrive_claims_no_time_from_its_arrival() -> None:
    """A sidecar restarted while the engine ran on admits requests the old one queued. Its
    tracker dated them from their admission: their traces said 0 s queued, and first
    token and end to end times from the admission, with max_gen_len 0, as if measured.
    Those figures are unknown (-1), the arrival time is the admission's (the latest the
    request can have arrived, so the client join still finds its API request), and
    requests it saw arrive keep their measured times, equal to their events'."""
    from tests.clickhouse.twinrun import run_twin_restarting_sidecar

    before: list[Any] = []
    after: list[Any] = []
    run_twin_restarting_sidecar(before.append, after.append, restart_step=300,
                                outage_steps=5, spec=WorkloadSpec(
                                    n_requests=80, seed=5, waves=8, wave_interval_steps=100))
    seen = {e.request_id: e.ts for e in after
            if isinstance(e, RequestEvent) and e.event == "queued"}
    admitted = {e.request_id: e.ts for e in after
                if isinstance(e, RequestEvent) and e.event == "admitted"}
    traces = [t for t in after if isinstance(t, RequestTrace)]
    unseen = [t for t in traces if t.request_id not in seen and t.request_id in admitted]
    assert unseen and len(unseen) < len(traces)  # (those admitted before: the next test)
    for t in unseen:
        assert (t.queue_seconds, t.first_token_seconds, t.e2e_seconds, t.max_gen_len) == (
            -1.0, -1.0, -1.0, -1), t
        assert t.arrival_ts == admitted[t.request_id]
    for t in traces:
        if t.request_id in seen:
            assert t.arrival_ts == seen[t.request_id] and t.max_gen_len > 0
            assert t.queue_seconds == pytest.approx(admitted[t.request_id] - t.arrival_ts)
            assert t.e2e_seconds == pytest.approx(t.ts - t.arrival_ts) and t.e2e_seconds > 0


def test_a_request_running_when_a_sidecar_takes_the_engine_up_gets_its_trace() -> None:
    """A sidecar restarted while the engine runs on takes up the requests that were running
    at the keyframe it starts from. It wrote no trace for them when they ended, only their
    end events: every rolling update of the sidecars left the requests in flight out of
    every count built from traces. Each now gets one: vLLM's own figures from its end
    (lengths, preemptions, cached tokens), its blocks from the keyframe's table on (a
    finished request's last table is its largest), and every time unknown (-1), its
    arrival dated the step it was taken up in, its ``taken_up`` event's or its resume's
    (the latest it can have arrived)."""
    from kvscope_probe.wire import cdiv
    from tests.clickhouse.twinrun import run_twin_restarting_sidecar

    before: list[Any] = []
    after: list[Any] = []
    run_twin_restarting_sidecar(before.append, after.append, restart_step=300,
                                outage_steps=5, spec=WorkloadSpec(
                                    n_requests=80, seed=5, waves=8, wave_interval_steps=100))
    events = [e for e in after if isinstance(e, RequestEvent)]
    ends = {e.request_id for e in events if e.event in ("finished", "aborted")}
    came = {e.request_id for e in events if e.event in ("queued", "admitted")}
    traces = {t.request_id: t for t in after if isinstance(t, RequestTrace)}
    assert set(traces) == ends  # one trace for every end the new sidecar heard
    held = {e.request_id for e in before if isinstance(e, RequestEvent)
            and e.event in ("admitted", "resumed")}
    taken_up = ends - came
    assert taken_up and taken_up <= held  # running at the restart, admitted before it
    queued = {e.request_id: e.ts for e in before
              if isinstance(e, RequestEvent) and e.event == "queued"}
    first_heard = {}
    for e in events:
        first_heard.setdefault(e.request_id, e.ts)
    preempted_after = [e.request_id for e in events if e.event == "preempted"]
    for rid in taken_up:
        t = traces[rid]
        assert (t.queue_seconds, t.first_token_seconds, t.e2e_seconds, t.max_gen_len,
                t.free_blocks_at_alloc, t.max_contiguous_free_blocks_at_alloc) == (
            -1.0, -1.0, -1.0, -1, -1, -1), t
        assert queued[rid] <= t.arrival_ts <= first_heard[rid]  # the latest it can have come
        took = [e for e in events if e.request_id == rid and e.event == "taken_up"]
        if took:  # running at the keyframe: its table then, the step the trace dates it
            (e,) = took
            assert e.ts == t.arrival_ts == first_heard[rid] and 0 < e.total_blocks
            assert e.total_blocks == e.blocks <= t.allocated_blocks
        else:  # waiting after a preemption then: its resume takes it up, and what that
            # preemption discarded is unknown: never "recomputing 0 tokens"
            assert [e.event for e in events if e.request_id == rid][0] == "resumed"
            (d,) = [d for d in after if isinstance(d, SchedulerDecision)
                    and d.request_id == rid and d.decision == "resume"]
            assert d.tokens == -1 and "(unknown)" in d.msg, d
        assert t.finish_reason == "FINISHED_LENGTH_CAPPED"
        if t.preempt_count > sum(p == rid for p in preempted_after):  # some before: unknown
            assert t.recomputed_tokens == -1, t
    assert any(traces[rid].recomputed_tokens == -1 for rid in taken_up)
    assert {e.request_id for e in events if e.event == "taken_up"} < taken_up
    for t in traces.values():  # the blocks rule every finished request keeps, taken up or not
        if t.finish_reason == "FINISHED_LENGTH_CAPPED":
            assert t.allocated_blocks == cdiv(t.prompt_len + t.output_len - 1,
                                              TwinConfig().block_size), t
