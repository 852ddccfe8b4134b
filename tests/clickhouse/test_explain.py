"""``kvscope explain`` on chDB: one twin run (vLLM's real scheduler, the probe, the
RequestTracker) written through the ClickHouse sink; each answer is checked against the rows
the tracker emitted, computed again here from those rows."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from datetime import datetime, timezone
from typing import Any

import jsonschema
import pytest

from kvscope import cli
from kvscope.explain import answer, render_json, render_text
from kvscope.explain.story import facts
from kvscope.rows import (
    ClientRequest,
    EngineConfig,
    RequestEvent,
    RequestTrace,
    as_tuple,
    columns,
    unrolled,
)
from tests.clickhouse.test_queries import Run, run  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.clickhouse, pytest.mark.twin]
SCHEMA = render_json.schema()


def valid(body: Any, definition: str = "answer") -> None:
    jsonschema.validate(json.loads(json.dumps(body)), {**SCHEMA, "$ref": f"#/$defs/{definition}"})


def events_of(r: Run) -> dict[str, list[RequestEvent]]:
    by: dict[str, list[RequestEvent]] = defaultdict(list)
    for e in unrolled(r.rows):
        if isinstance(e, RequestEvent):
            by[e.request_id].append(e)
    return by


def ms(ts: float) -> float:
    return round(ts, 3)


def test_every_preempted_request_story_equals_its_events(run: Run) -> None:  # noqa: F811
    by = events_of(run)
    preempted = [t for t in run.traces if t.preempt_count > 0]
    assert len(preempted) >= 5
    for t in preempted:
        got = answer.explain(run.client, t.request_id)
        valid(got)
        (r,) = got["engine_requests"]
        mine = [e for e in by[t.request_id] if e.event == "preempted"]
        assert len(r["preemptions"]) == len(mine) == t.preempt_count
        assert [p["step"] for p in r["preemptions"]] == [e.step for e in mine]
        assert [p["blocks_needed"] for p in r["preemptions"]] == [
            int(facts(e.detail)["blocks_needed"]) for e in mine]
        assert [p["requester"] for p in r["preemptions"]] == [
            facts(e.detail)["requester"] for e in mine]
        resumed = [e for e in by[t.request_id] if e.event == "resumed"]
        assert [p["resumed"]["step"] for p in r["preemptions"]] == [e.step for e in resumed]
        lost = r["lost"]
        queued = next(e for e in by[t.request_id] if e.event == "queued")
        admitted = next(e for e in by[t.request_id] if e.event == "admitted")
        end = next(e for e in by[t.request_id] if e.event == "finished")
        assert lost["waiting"]["steps"] == admitted.step - queued.step
        assert lost["preempted"]["steps"] == sum(b.step - a.step for a, b in
                                                 zip(mine, resumed, strict=True))
        assert lost["total"]["steps"] == end.step - queued.step
        assert (lost["waiting"]["steps"] + lost["preempted"]["steps"]
                + lost["running"]["steps"]) == lost["total"]["steps"]
        # the store keeps milliseconds: the parts add up to the traced e2e within 1 ms
        assert lost["total"]["seconds"] == pytest.approx(t.e2e_seconds, abs=0.0015)
        assert lost["waiting"]["seconds"] == pytest.approx(t.queue_seconds, abs=0.0015)
        assert 0 < lost["recomputing"]["steps"] <= lost["running"]["steps"]
        by_state = defaultdict(int)
        for sp in r["spans"]:
            by_state[sp["state"]] += sp["to_step"] - sp["from_step"]
        assert by_state["preempted"] == lost["preempted"]["steps"]
        assert by_state["waiting"] == lost["waiting"]["steps"]
        assert by_state["running"] == lost["running"]["steps"]


def test_each_preemption_trigger_was_admitted_or_grew_in_that_step(run: Run) -> None:  # noqa: F811
    by_step: dict[tuple[str, int], set[str]] = defaultdict(set)
    for e in unrolled(run.rows):
        if isinstance(e, RequestEvent) and e.event in ("admitted", "resumed", "allocated"):
            by_step[(e.request_id, e.step)].add(e.event)
    seen = selfs = 0
    for t in [t for t in run.traces if t.preempt_count > 0]:
        (r,) = answer.explain(run.client, t.request_id)["engine_requests"]
        for p in r["preemptions"]:
            assert p["requester"], p  # the twin's preemptions all come from an allocation
            if p["requester_is_victim"]:  # it needed a block and was last in line itself
                assert p["requester"] == t.request_id and p["trigger"] is None
                selfs += 1
            else:
                assert p["trigger"] is not None
                assert p["trigger"]["event"] in by_step[(p["requester"], p["step"])]
            assert p["policy"] == "fcfs"
            seen += 1
    assert seen == sum(t.preempt_count for t in run.traces)
    assert 0 < selfs < seen  # both kinds occur in this run


def held_by_replay(r: Run, step: int) -> dict[str, int]:
    """Blocks each request held as ``step`` began, replaying the tracker's events. A
    request's end comes in the record of the step after vLLM freed its blocks (in
    ``update_from_output``, before that step's ``schedule()``): one that ends at ``step``
    held nothing as it began."""
    held: dict[str, int] = {}
    events = [e for e in unrolled(r.rows) if isinstance(e, RequestEvent)]
    for e in sorted((e for e in events if e.step < step), key=lambda e: (e.step, e.ts)):
        if e.event in ("admitted", "resumed", "allocated", "taken_up"):
            held[e.request_id] = e.total_blocks
        else:
            held.pop(e.request_id, None)
    for e in events:
        if e.step == step and e.event in ("finished", "aborted"):
            held.pop(e.request_id, None)
    return {k: v for k, v in held.items() if v > 0}


def test_holders_at_each_preemption_are_the_pool_as_the_step_began(run: Run) -> None:  # noqa: F811
    """Every preemption of the run, and the waits of the preempted requests."""
    for t in (t for t in run.traces if t.preempt_count):
        (r,) = answer.explain(run.client, t.request_id)["engine_requests"]
        for p in r["preemptions"]:
            held = held_by_replay(run, p["step"])
            h = p["holders"]
            assert h["held_blocks"] == sum(held.values()) and h["requests"] == len(held)
            top = sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
            assert [(x["key"], x["blocks"]) for x in h["by_request"]] == top
            assert held[t.request_id] == p["victim_blocks"]  # the victim held what it lost
        w = r["waiting"]
        if w is not None:
            assert w["holders"]["held_blocks"] == sum(
                v for k, v in held_by_replay(run, w["step"]).items() if k != t.request_id)



def test_a_waiting_request_is_measured_against_the_engines_usable_blocks(run: Run) -> None:  # noqa: F811
    (cfg,) = [r for r in run.rows if isinstance(r, EngineConfig)]  # one probe session
    assert cfg.kv_group_kinds == ["FullAttentionSpec"]
    waited = sorted((t for t in run.traces if t.queue_seconds > 0),
                    key=lambda t: (-t.queue_seconds, t.request_id))[:5]
    assert waited
    seen = 0
    for t in waited:
        (r,) = answer.explain(run.client, t.request_id)["engine_requests"]
        w = r["waiting"]
        queued = next(e for e in events_of(run)[t.request_id] if e.event == "queued")
        assert w["step"] == queued.step  # the first step it waited through
        named = [d for d in run.decisions if d.decision == "admission_blocked"
                 and d.request_id == t.request_id]  # the tracker's own rows, as emitted
        assert w["admission_blocked"] == len(named)
        assert w["admission_blocked_reasons"] == dict(Counter(d.reason for d in named))
        seen += len(named)
        fit = w["could_fit"]
        # the pool as its probe reported it, less the null block; one full-attention group
        assert (fit["pool_blocks"], fit["usable_blocks"]) == (cfg.num_blocks, cfg.num_blocks - 1)
        assert fit["full_attention_blocks"] == fit["required_blocks"] == t.required_blocks
        assert fit["fits"] is (t.required_blocks <= cfg.num_blocks - 1)
    assert seen > 0  # the longest waits were behind blocked heads: reasons were compared


def test_worst_ranks_by_time_lost_waiting_and_preempted(run: Run) -> None:  # noqa: F811
    by = events_of(run)
    lost = {}
    for rid, evs in by.items():
        ts = {k: [ms(e.ts) for e in evs if e.event == k] for k in
              ("queued", "admitted", "preempted", "resumed")}
        lost[rid] = ts["admitted"][0] - ts["queued"][0] + sum(ts["resumed"]) - sum(
            ts["preempted"])
    got = answer.worst(run.client, 5, 0)
    valid(got, "worst")
    want = sorted(lost, key=lambda k: (-lost[k], k))[:5]
    assert [x["request_id"] for x in got["requests"]] == want
    for x in got["requests"]:
        assert x["lost_s"] == pytest.approx(lost[x["request_id"]], abs=1e-6)
        assert x["preemptions"] == len([e for e in by[x["request_id"]]
                                        if e.event == "preempted"])
    assert answer.worst(run.client, 5, 1e12)["requests"] == []


def test_the_callers_request_id_finds_its_engine_request(run: Run) -> None:  # noqa: F811
    t = max(run.traces, key=lambda t: (t.preempt_count, t.request_id))
    row = ClientRequest(ts=t.ts + 0.01, request_id="ticket-4711", engine_request_ids=t.request_id,
                        model=t.model, endpoint="/v1/completions", client_id="acme",
                        user_agent="curl/8", api_key_hash="", prompt_hash="", prompt_chars=10,
                        max_tokens=t.max_gen_len, http_status=200, duration_s=t.e2e_seconds,
                        duplicate=False, duplicate_of="", preempt_count=t.preempt_count,
                        preempt_reason="kv_full", engine_ids=[t.request_id])
    values = (datetime.fromtimestamp(row.ts, tz=timezone.utc),) + as_tuple(row)[1:]
    run.client.insert("client_requests", [values], column_names=columns("client_requests"))
    got = answer.explain(run.client, "ticket-4711")
    valid(got)
    assert [a["client_id"] for a in got["api_requests"]] == ["acme"]
    assert [r["request_id"] for r in got["engine_requests"]] == [t.request_id]
    assert len(got["engine_requests"][0]["preemptions"]) == t.preempt_count
    # the API row's duration is the traced e2e here: nothing outside the engine (1 ms: the
    # store keeps milliseconds)
    assert got["engine_requests"][0]["outside_engine_s"] == pytest.approx(0, abs=0.0015)
    assert "client acme" in render_text.render(got)


def test_cli_unknown_id_and_never_preempted(run: Run, capsys: pytest.CaptureFixture[str],  # noqa: F811
                                            tmp_path: Any) -> None:
    base = ["explain", "--dsn", run.dsn, "--database", run.database]
    assert cli.main([*base, "no-such-request"]) == 3
    err = capsys.readouterr().err
    assert "no request 'no-such-request' in the store" in err and "Traceback" not in err
    calm: RequestTrace = next(t for t in run.traces if t.preempt_count == 0)
    assert cli.main([*base, calm.request_id]) == 0
    out = capsys.readouterr().out
    assert "never preempted" in out and f"engine request {calm.request_id}" in out
    assert cli.main([*base, calm.request_id, "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    valid(body)
    assert body["engine_requests"][0]["preemptions"] == []
    assert cli.main([*base, "--worst", "3", "--since", "0", "--format", "json"]) == 0
    valid(json.loads(capsys.readouterr().out), "worst")
    assert cli.main(base) == 2
    rid = max(run.traces, key=lambda t: (t.preempt_count, t.request_id)).request_id
    assert cli.main([*base, rid, "--png", str(tmp_path / "r.png")]) == 0
    assert f"engine request {rid}" in capsys.readouterr().out
    from PIL import Image

    from kvscope.explain import png
    with Image.open(tmp_path / "r.png") as img:
        assert img.size == (png.WIDTH, png.png_height(answer.explain(run.client, rid)))


def _ev(rid: str, event: str, step: int, ts: float, blocks: int = -1,
        detail: str = "") -> RequestEvent:
    return RequestEvent(ts=ts, model="m", engine="0", server="", request_id=rid, event=event,
                        step=step, blocks=blocks, total_blocks=blocks, free_blocks=-1,
                        max_contiguous_free=-1, tokens=0, reason="", detail=detail)


def test_worst_counts_requests_that_ended_waiting_or_preempted(store_rows: Any) -> None:
    """Aborted in the queue (never admitted: left out before) and aborted while preempted
    (never resumed: its preempted seconds read about -1.7e9, an epoch time subtracted)."""
    t0 = 1_800_000_000.0
    client = store_rows([
        _ev("gave-up", "queued", 1, t0), _ev("gave-up", "aborted", 40, t0 + 30.0),
        _ev("dropped", "queued", 2, t0 + 1.0), _ev("dropped", "admitted", 3, t0 + 2.0),
        _ev("dropped", "preempted", 5, t0 + 4.0), _ev("dropped", "aborted", 30, t0 + 24.0)])
    got = {r["request_id"]: r for r in answer.worst(client, 5, 0)["requests"]}
    assert set(got) == {"gave-up", "dropped"}
    assert (got["gave-up"]["waiting_s"], got["gave-up"]["preempted_s"]) == (30.0, 0.0)
    assert (got["dropped"]["waiting_s"], got["dropped"]["preempted_s"]) == (1.0, 20.0)
    assert got["dropped"]["preemptions"] == 1


def test_worst_of_one_engine(store_rows: Any) -> None:
    """The fleet dashboard's command names a server and an engine: ``--engine`` keeps the
    requests of that engine only (the others' losses are larger here)."""
    from dataclasses import replace

    t0 = 1_800_000_000.0
    rows = [_ev("a", "queued", 1, t0), _ev("a", "finished", 9, t0 + 5.0),
            _ev("b", "queued", 1, t0), _ev("b", "finished", 9, t0 + 50.0)]
    client = store_rows([*rows[:2], *(replace(r, engine="1") for r in rows[2:])])
    got = answer.worst(client, 5, 0, engine="0")
    valid(got, "worst")
    assert [(r["request_id"], r["engine"]) for r in got["requests"]] == [("a", "0")]
    assert got["engine"] == "0"
    assert [r["request_id"] for r in answer.worst(client, 5, 0)["requests"]] == ["b", "a"]


def test_a_request_that_ended_in_the_preemptions_step_held_nothing_as_it_began(
        store_rows: Any) -> None:
    """vLLM frees a finished request's blocks in update_from_output, before the next
    schedule(); the probe sends its end with that next step's record. "done" ended in
    step 5, the step "victim" was preempted in: it held none of the pool as step 5
    began, and was listed as holding its 10 blocks."""
    t0 = 1_800_000_000.0
    client = store_rows([
        _ev("done", "queued", 1, t0), _ev("done", "admitted", 1, t0 + 0.1, blocks=10),
        _ev("victim", "queued", 1, t0), _ev("victim", "admitted", 2, t0 + 0.2, blocks=4),
        _ev("other", "queued", 1, t0), _ev("other", "admitted", 2, t0 + 0.2, blocks=3),
        _ev("done", "finished", 5, t0 + 0.5),
        _ev("victim", "preempted", 5, t0 + 0.51, blocks=4,
            detail="requester=other blocks_needed=2"),
        _ev("other", "finished", 8, t0 + 0.8),
        _ev("victim", "resumed", 6, t0 + 0.6, blocks=4),
        _ev("victim", "finished", 9, t0 + 0.9)])
    (r,) = answer.explain(client, "victim")["engine_requests"]
    (p,) = r["preemptions"]
    assert [(x["key"], x["blocks"]) for x in p["holders"]["by_request"]] == [
        ("victim", 4), ("other", 3)]
    assert p["holders"]["held_blocks"] == 7


def test_the_pool_at_a_step_is_read_from_the_requests_own_run(store_rows: Any) -> None:
    """Step numbers restart with every run of an engine (its restart or the sidecar's).
    A request of an earlier run (a1: admitted at step 5, ended at step 60) was listed as
    holding the pool at step 20 of a later run, and a later run's events (c1) were read
    as the step after a resume. Runs an hour apart, and a run after the asked one."""
    t0, t1, t2 = 1_800_000_000.0, 1_800_003_600.0, 1_800_007_200.0
    client = store_rows([
        # an earlier run
        _ev("a1", "queued", 1, t0), _ev("a1", "admitted", 5, t0 + 0.05, blocks=8),
        _ev("a1", "finished", 60, t0 + 1.0),
        # the asked request's run
        _ev("b2", "queued", 1, t1), _ev("b2", "admitted", 2, t1 + 0.02, blocks=3),
        _ev("b1", "queued", 1, t1), _ev("b1", "admitted", 2, t1 + 0.02, blocks=4),
        _ev("b1", "preempted", 20, t1 + 0.2, blocks=4,
            detail="requester=b2 blocks_needed=2"),
        _ev("b1", "resumed", 25, t1 + 0.25, blocks=4),
        _ev("b2", "finished", 30, t1 + 0.3), _ev("b1", "finished", 40, t1 + 0.4),
        # a later run
        _ev("c1", "queued", 1, t2), _ev("c1", "admitted", 26, t2 + 0.1, blocks=9),
        _ev("c1", "finished", 80, t2 + 1.0)])
    (r,) = answer.explain(client, "b1")["engine_requests"]
    (p,) = r["preemptions"]
    assert [(x["key"], x["blocks"]) for x in p["holders"]["by_request"]] == [
        ("b1", 4), ("b2", 3)]
    # recomputing ends as the step after the resume began: b2's end at step 30
    assert r["lost"]["recomputing"]["seconds"] == pytest.approx(0.3 - 0.25)


def test_a_victim_preempted_and_resumed_in_one_step_is_read_in_that_order(
        store_rows: Any) -> None:
    """reset_prefix_cache(reset_running_requests=True) preempts running requests before
    a schedule() that resumes them: one step holds both, in the same millisecond as
    stored. The tie put the resume first: the preemption read as never resumed, out
    until the request's end."""
    t0 = 1_800_000_000.0
    client = store_rows([
        _ev("r", "queued", 1, t0), _ev("r", "admitted", 2, t0 + 0.1, blocks=4),
        _ev("r", "preempted", 6, t0 + 0.5001, blocks=4, detail="requester= blocks_needed=-1"),
        _ev("r", "resumed", 6, t0 + 0.5003, blocks=4),
        _ev("r", "finished", 9, t0 + 0.9)])
    (r,) = answer.explain(client, "r")["engine_requests"]
    assert [e["event"] for e in r["timeline"]] == [
        "queued", "admitted", "preempted", "resumed", "finished"]
    (p,) = r["preemptions"]
    assert p["resumed"] == {"ts": t0 + 0.5, "step": 6}
    assert r["lost"]["preempted"] == {"seconds": 0.0, "steps": 0}


class _Preempted(Exception):
    """Stops a twin run right after the step of its first preemption."""


def test_the_api_answers_a_preemption_a_moment_ago_with_the_pool_as_vllm_held_it(
        chdb_dsn: str, database: str, tmp_path: Any) -> None:
    """The sidecar's ``/api/requests/{id}`` right after a preemption: the tracker keeps
    allocations up to 5 s of engine time before it writes them, and the API flushed only
    the sink, so holders left out the requests that had only grown since (and read the
    others' blocks of before). The answer's holders are vLLM's running requests' blocks
    as the preemption's step began."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from kvscope.explain.api import explain_router
    from kvscope.sidecar.http.app import create_app
    from kvscope.sidecar.server import explain_reader
    from kvscope.sinks.base import SinkManager
    from kvscope.state.requests import RequestTracker
    from kvscope.store.sink import ClickHouseSink
    from kvscope.twin import TwinConfig, WorkloadSpec, generate
    from kvscope.twin.probed import ProbedTwin
    from tests.clickhouse.conftest import FAST

    sink = ClickHouseSink(chdb_dsn, database=database, options=FAST,
                          spool_dir=str(tmp_path / "spool"))
    sinks = SinkManager([sink])
    pt = ProbedTwin(TwinConfig(num_blocks=48), seed=5)
    tracker = RequestTracker(sinks.emit)
    pt.hub.listeners.append(tracker.on_event)
    mgr = pt.rec.mgr
    before: dict[str, int] = {}  # blocks of each running request as the next step begins
    seen: list[tuple[str, dict[str, int]]] = []

    def watch(_i: int, out: Any) -> None:
        if out.preempted_req_ids:
            seen.append((sorted(out.preempted_req_ids)[0], dict(before)))
            raise _Preempted
        before.clear()
        before.update({r.request_id: sum(map(len, mgr.get_block_ids(r.request_id)))
                       for r in pt.scheduler.running})

    with pytest.raises(_Preempted):
        pt.run(generate(WorkloadSpec(n_requests=80, seed=5)), on_step=watch)
    ((victim, truth),) = seen
    app = create_app(pt.hub, CollectorRegistry())
    app.include_router(explain_router(explain_reader(pt.hub, tracker, sink)))
    try:
        r = TestClient(app).get(f"/api/requests/{victim}")
        assert r.status_code == 200, r.text
        (req,) = r.json()["engine_requests"]
        p = req["preemptions"][0]
        ranked = sorted(truth.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
        assert [(x["key"], x["blocks"]) for x in p["holders"]["by_request"]] == ranked
        assert (p["holders"]["held_blocks"], p["holders"]["requests"]) == (
            sum(truth.values()), len(truth))
    finally:
        sinks.close()


def test_a_request_of_two_sidecar_runs_is_read_in_time_order(store_rows: Any) -> None:
    """Step numbers restart with each run of the sidecar: "r" was queued at step 500 of
    the run before, admitted at step 3 of the next. By step first its queued row came
    last (waiting -497 steps, -10 s); in time order it comes first, and the steps of two
    runs make no span: the story says it is incomplete rather than figures."""
    t0 = 1_800_000_000.0
    client = store_rows([
        _ev("r", "admitted", 3, t0 + 10.0, blocks=1), _ev("r", "finished", 50, t0 + 20.0),
        _ev("r", "queued", 500, t0)])
    body = answer.explain(client, "r")
    valid(body)
    (r,) = body["engine_requests"]
    assert [e["event"] for e in r["timeline"]] == ["queued", "admitted", "finished"]
    assert r["lost"] is None
    assert r["incomplete"] == ["its events span two runs (step numbers restarted)"]
    assert r["verdict"] == ("incomplete: its events span two runs (step numbers "
                            "restarted); where its time went is not known")


def test_missing_rows_make_an_incomplete_story_not_figures(store_rows: Any) -> None:
    """A request that started before the sidecar has no queued row (nor admitted, when it
    ran then): its story read "waited 0.000 s; never preempted" from a finished row alone,
    though its end said vLLM preempted it twice, and the API server was given the engine's
    missing time. A resume with no preemption before it is another gap."""
    t0 = 1_800_000_000.0
    end = RequestEvent(ts=t0 + 30.0, model="m", engine="0", server="", request_id="c",
                       event="finished", step=80, blocks=-1, total_blocks=-1, free_blocks=-1,
                       max_contiguous_free=-1, tokens=700, reason="",
                       detail="FINISHED_LENGTH_CAPPED")
    trace = RequestTrace(
        ts=t0 + 30.0, model="m", engine="0", server="", request_id="c", prompt_len=600,
        max_gen_len=100, output_len=100, required_blocks=44, allocated_blocks=44,
        contiguous_allocated=True, block_fragments=1, preempt_count=2,
        preempt_reason="kv_full", recomputed_tokens=0, cached_tokens=0,
        free_blocks_at_alloc=-1, max_contiguous_free_blocks_at_alloc=-1, arrival_ts=t0,
        queue_seconds=-1.0, first_token_seconds=-1.0, e2e_seconds=30.0,
        finish_reason="FINISHED_LENGTH_CAPPED")
    client = store_rows([
        end, trace,
        ClientRequest(ts=t0 + 30.5, request_id="c", engine_request_ids="c", model="m",
                      endpoint="/v1/completions", client_id="", user_agent="",
                      api_key_hash="", prompt_hash="", prompt_chars=10, max_tokens=100,
                      http_status=200, duration_s=31.0, duplicate=False, duplicate_of="",
                      preempt_count=2, preempt_reason="kv_full", engine_ids=["c"]),
        _ev("b", "queued", 1, t0), _ev("b", "admitted", 2, t0 + 1.0, blocks=4),
        _ev("b", "resumed", 9, t0 + 5.0, blocks=4), _ev("b", "finished", 12, t0 + 8.0)])
    body = answer.explain(client, "c")
    valid(body)
    (c,) = body["engine_requests"]
    assert (c["lost"], c["outside_engine_s"]) == (None, None)
    assert c["incomplete"] == [
        "no queued event (it arrived before the sidecar saw its engine, or the row is lost)",
        "no admitted event", "vLLM counted 2 preemptions, the store holds 0"]
    text = render_text.render(body)
    assert "waited" not in text and "never preempted" not in text
    assert "  where the time went: not known (the story is incomplete)" in text
    (b,) = answer.explain(client, "b")["engine_requests"]
    assert b["incomplete"] == ["a resume with no preemption before it"]
    assert b["lost"] is None


def _trace(rid: str, server: str, ts: float, preempt_count: int) -> RequestTrace:
    return RequestTrace(
        ts=ts, model="m", engine="0", server=server, request_id=rid, prompt_len=10,
        max_gen_len=10, output_len=10, required_blocks=2, allocated_blocks=2,
        contiguous_allocated=True, block_fragments=1, preempt_count=preempt_count,
        preempt_reason="", recomputed_tokens=0, cached_tokens=0, free_blocks_at_alloc=-1,
        max_contiguous_free_blocks_at_alloc=-1, arrival_ts=ts - 1.0, queue_seconds=0.1,
        first_token_seconds=0.2, e2e_seconds=1.0, finish_reason="FINISHED_STOPPED")


def test_the_trace_is_the_requests_own_engines(store_rows: Any) -> None:
    """vLLM's request IDs are unique per server, not across servers: the trace was read by
    ID alone, and the last one written (another server's, preempted 3 times) was the
    request's, making its story incomplete."""
    t0 = 1_800_000_000.0
    client = store_rows([
        _ev("x", "queued", 1, t0), _ev("x", "admitted", 2, t0 + 0.1, blocks=2),
        _ev("x", "finished", 5, t0 + 1.0), _trace("x", "", t0 + 1.0, 0),
        _trace("x", "other", t0 + 50.0, 3)])
    (r,) = answer.explain(client, "x")["engine_requests"]
    assert (r["trace"]["server"], r["trace"]["preempt_count"]) == ("", 0)
    assert r["incomplete"] == [] and r["verdict"].endswith("never preempted")


def test_a_store_older_than_the_command_is_named_with_the_fix(
        store_rows: Any, chdb_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A newer ``kvscope explain`` against a store whose tables a newer sidecar has not
    altered yet (the CLI upgraded first) printed ClickHouse's unknown-identifier error,
    which reads as a kvscope bug. It still exits 1 (the store), and says what to do."""
    t0 = 1_800_000_000.0
    client = store_rows([_ev("a", "queued", 1, t0), _ev("a", "finished", 9, t0 + 5.0)])
    db = client.database
    client.command("ALTER TABLE client_requests DROP COLUMN engine_ids")  # before 130
    assert cli.main(["explain", "a", "--dsn", chdb_dsn, "--database", db]) == 1
    err = capsys.readouterr().err
    assert "engine_ids" in err and "Traceback" not in err
    assert "older than this kvscope" in err and "kvscope serve" in err


def test_a_store_from_before_step_counters_is_explained_as_one_count(
        store_rows: Any, chdb_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A store the fleet's older sidecars still write (request events with no
    ``step_counter``, the view as 150 made it) read by a newer CLI: explain answers from it
    as before, each row of no named count, where it exited 1 on the column it now reads."""
    from tests.clickhouse.test_schema import before_step_counters

    t0 = 1_800_000_000.0
    client = store_rows([_ev("a", "queued", 1, t0), _ev("a", "admitted", 2, t0 + 1.0, blocks=3),
                         _ev("a", "finished", 9, t0 + 5.0)])
    db = client.database
    client.command("DROP VIEW request_events_all")
    for table in ("request_events", "request_allocations"):
        client.command(f"ALTER TABLE {table} DROP COLUMN step_counter")
    from kvscope.store import schema
    (view,) = [stmt for stmt in before_step_counters(schema.render_schema(db, 7))
               if "VIEW" in stmt and "request_events_all" in stmt]
    client.command(view)
    assert cli.main(["explain", "a", "--dsn", chdb_dsn, "--database", db,
                     "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    valid(body)
    (r,) = body["engine_requests"]
    assert [(e["event"], e["step_counter"]) for e in r["timeline"]] == [
        ("queued", ""), ("admitted", ""), ("finished", "")]
    assert r["lost"]["waiting"]["steps"] == 1


def test_the_pool_after_a_sidecar_restart_is_read_from_the_new_count_with_what_it_took_up(
        store_rows: Any) -> None:
    """A sidecar restarted while the engine ran on numbers the steps from 1 again; a request
    it took up (running then) holds its keyframe table from its ``taken_up`` event on. At a
    preemption the new sidecar stored, the pool is read from the new count alone: a
    request whose events span both counts (queued by the old sidecar, preempted after the
    restart) read the old count's steps as the new one's, and missed the requests taken up
    until they grew."""
    from kvscope.twin import WorkloadSpec
    from tests.clickhouse.twinrun import run_twin_restarting_sidecar

    before: list[Any] = []
    after: list[Any] = []
    run_twin_restarting_sidecar(before.append, after.append, restart_step=300,
                                outage_steps=5, spec=WorkloadSpec(
                                    n_requests=80, seed=5, waves=8, wave_interval_steps=100))
    client = store_rows(before + after)
    new = Run(client, [], [], after, "", "")
    took = {e.request_id for e in after if isinstance(e, RequestEvent)
            and e.event == "taken_up"}
    restart = min(e.ts for e in after if isinstance(e, RequestEvent))
    victims = sorted({e.request_id for e in after if isinstance(e, RequestEvent)
                      and e.event == "preempted"})
    checked = with_taken_up = spanning = 0
    for rid in victims:
        (r,) = answer.explain(client, rid)["engine_requests"]
        spanning += any(e["ts"] < restart for e in r["timeline"])
        for p in (p for p in r["preemptions"] if p["ts"] >= restart):
            held = held_by_replay(new, p["step"])
            h = p["holders"]
            assert h["held_blocks"] == sum(held.values()) and h["requests"] == len(held), p
            top = sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
            assert [(x["key"], x["blocks"]) for x in h["by_request"]] == top
            checked += 1
            with_taken_up += bool(took & set(held))
    assert checked and with_taken_up and spanning
