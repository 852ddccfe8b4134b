"""Client correlation: parsing vLLM's engine IDs, keyed hashes, joins under caller-chosen
(reused, oversized, hostile) request IDs, duplicates, bounded labels, the preempt-rate
answer."""

from __future__ import annotations

import hashlib
import hmac

from kvscope.rows import ClientRequest, RequestTrace
from kvscope.sidecar.http.pressure import preempt_rate
from kvscope.state.client_stats import LabelSlots
from kvscope.state.clients import LATE_ROW_S, MAX_SAME_KEY, ClientJoin, caller_id
from kvscope.state.hashkey import Keyer
from kvscope.state.hub import Hub
from kvscope_probe import wire
from kvscope_probe.middleware import request_key
from tests.unit.test_hub import feed, keyframe
from tests.unit.test_wire import hello, step

RID = "kvs" + "ab" * 16
SECRET = b"0123456789abcdef-test-secret"
KEYER = Keyer(SECRET)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def start(rid: str = RID, client: str = "team-a", prompt: str = "p1", ts: float = 100.0,
          agent: str = "curl/8", call: str = "") -> wire.ClientStart:
    return wire.ClientStart(rid, ts, "completions", "tiny", client, agent, "", digest(prompt),
                            10, 16, call)


def end(rid: str = RID, ts: float = 101.0, call: str = "", status: int = 200) -> wire.ClientEnd:
    return wire.ClientEnd(rid, ts, status, 0.9, call)


def trace(engine_id: str, preempts: int = 0, arrival: float = 100.5) -> RequestTrace:
    return RequestTrace(ts=1.0, model="tiny", engine="0", request_id=engine_id, prompt_len=4,
                        max_gen_len=16, output_len=16, required_blocks=1, allocated_blocks=1,
                        contiguous_allocated=True, block_fragments=1, preempt_count=preempts,
                        preempt_reason="kv_full" if preempts else "", recomputed_tokens=0,
                        cached_tokens=0, free_blocks_at_alloc=3,
                        max_contiguous_free_blocks_at_alloc=3, arrival_ts=arrival,
                        queue_seconds=0.1, first_token_seconds=0.2, e2e_seconds=0.5,
                        finish_reason="FINISHED_STOPPED")


def join(**kw: object) -> tuple[ClientJoin, list[object]]:
    out: list[object] = []
    return ClientJoin(out.append, keyer=KEYER, **kw), out  # type: ignore[arg-type]


def rows(out: list[object]) -> list[ClientRequest]:
    return [r for r in out if isinstance(r, ClientRequest)]


def traces(out: list[object]) -> list[RequestTrace]:
    return [r for r in out if isinstance(r, RequestTrace)]


class Clock:
    """A settable stand-in for time.monotonic."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def ticking(j: ClientJoin, clock: Clock, seconds: float, every_s: float = 0.1) -> None:
    """``seconds`` of a sidecar that keeps up: the ingest thread ticks every ``every_s``."""
    for _ in range(round(seconds / every_s)):
        clock.t += every_s
        j.tick()


def test_engine_ids_of_vllm_032_give_back_the_request_id_exactly() -> None:
    """The forms vLLM 0.32 builds (serving.py, input_processor.assign_request_id,
    parallel_sampling.get_child_info), around IDs a caller may choose."""
    for rid in (RID, "kvs-3-17", "a-1", "x-0-deadbeef", "t\xe9st id/1;q=\"2\"", "", "7_x", "-"):
        assert caller_id(f"cmpl-{rid}-0-1a2b3c4d") == rid
        assert caller_id(f"cmpl-{rid}-12-00000000") == rid
        assert caller_id(f"chatcmpl-{rid}-1a2b3c4d") == rid
        assert caller_id(f"3_cmpl-{rid}-0-1a2b3c4d") == rid  # sample 3 of n > 1
        assert caller_id(f"0_chatcmpl-{rid}-1a2b3c4d") == rid
    for other in ("r12", f"cmpl-{RID}", f"cmpl-{RID}-1a2b3c4d", f"chatcmpl-{RID}",
                  f"cmpl-{RID}-x-1a2b3c4d", f"cmpl-{RID}-0-1A2B3C4D", f"resp_{RID}-1a2b3c4d",
                  f"embd-{RID}-0-1a2b3c4d"):
        assert caller_id(other) is None, other


def test_stored_hashes_are_keyed_and_still_equal_for_equal_prompts() -> None:
    j, out = join(duplicate_window_s=10)
    j.on_client(start(call="c1"))
    j.on_client(start(rid="second", ts=105.0, call="c2"))  # the same prompt again
    j.on_client(end(call="c1"))
    j.on_client(end(rid="second", call="c2"))
    j.flush()
    first, second = rows(out)
    want = hmac.new(SECRET, b"prompt\0" + digest("p1").encode(), hashlib.sha256).hexdigest()
    assert first.prompt_hash == second.prompt_hash == want[:16]
    assert first.prompt_hash not in digest("p1")  # the unkeyed digest is nowhere
    assert second.duplicate and second.duplicate_of == RID
    other = ClientJoin(lambda _r: None, keyer=Keyer(b"another-deployment-key"))
    assert other.keyer("prompt", digest("p1")) != first.prompt_hash
    assert KEYER("api_key", digest("sk-1")) != KEYER("prompt", digest("sk-1"))
    assert KEYER("prompt", "") == "" and SECRET.decode() not in repr(KEYER)


def test_trace_joined_to_its_client_and_row_written_at_the_answer() -> None:
    j, out = join()
    j.on_client(start())
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=2))
    j.on_client(end())
    t, row = out
    assert isinstance(t, RequestTrace) and t.client_id == "team-a"
    assert t.prompt_hash == KEYER("prompt", digest("p1"))
    assert isinstance(row, ClientRequest)
    assert row.engine_request_ids == f"cmpl-{RID}-0-deadbeef" and row.preempt_count == 2
    assert j.stats.preemptions == {"team-a": 2} and j.stats.requests == {"team-a": 1}


def test_an_answer_before_its_trace_waits_for_the_join() -> None:
    clock = Clock()
    j, out = join(join_wait_s=5, clock=clock)
    j.on_client(start())
    j.on_client(end())
    assert not rows(out)
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=1))
    (row,) = rows(out)
    assert row.engine_request_ids == f"cmpl-{RID}-0-deadbeef" and row.preempt_count == 1
    other = "kvs" + "cd" * 16
    j.on_client(start(rid=other))
    j.on_client(end(rid=other, ts=102.0))
    ticking(j, clock, 4.9)
    assert rows(out)[-1].request_id != other
    ticking(j, clock, 0.2)
    assert rows(out)[-1].request_id == other and rows(out)[-1].preempt_count == -1


def test_a_stalled_sidecar_still_joins_what_waited_in_its_queue() -> None:
    """The answer is read, then the sidecar stalls for 11 s (measured under CI load: its
    ingest thread descheduled) with the engine's trace queued behind it. The first tick
    after the stall must not give up on that trace: before, the row was written without
    its engine request and ``kvscope explain`` answered 404 for the caller's ID."""
    clock = Clock()
    j, out = join(join_wait_s=5, clock=clock)
    j.on_client(start())
    ticking(j, clock, 1.0)
    j.on_client(end())
    clock.t += 11.4  # the stall
    j.tick()
    assert not rows(out)
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=2))
    (row,) = rows(out)
    assert row.engine_request_ids == f"cmpl-{RID}-0-deadbeef" and row.preempt_count == 2
    (t,) = traces(out)
    assert t.client_id == "team-a" and j.stats.unjoined_traces == 0
    # the same for a trace that waits for its start: a stall is one tick of waiting
    other = "kvs" + "cd" * 16
    j.on_trace(trace(f"cmpl-{other}-0-deadbeef"))
    clock.t += 30.0
    j.tick()
    j.on_client(start(rid=other))
    j.tick()
    assert traces(out)[-1].client_id == "team-a" and j.stats.unjoined_traces == 0


def test_an_answer_waits_until_the_engines_reported_past_it() -> None:
    """Reproduces a CI failure: the answer was read, the sidecar kept ticking, and the
    engine's record of the request's end came more than ``join_wait_s`` later (the
    probe's frames behind the middleware's event). The row was written without its
    engine request, the trace joined the call afterwards, and ``kvscope explain`` answered
    404 for the caller's ID (tests/engine/shared/test_explain_engine.py, explain-11). The
    row now waits until every engine's records have passed the answer's time."""
    clock = Clock()
    horizon = [101.5]  # the latest time every engine's records reached
    j, out = join(join_wait_s=5, clock=clock, horizon=lambda: horizon[0])
    j.on_client(start())
    j.on_client(end(ts=102.0))
    ticking(j, clock, 8.0)
    assert not rows(out)  # the engine has not reported past the answer yet
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=1))
    assert not rows(out)  # another engine request of the call may still come (n > 1)
    horizon[0] = 102.5  # the records after the trace's: past the answer
    j.tick()
    (row,) = rows(out)
    assert row.engine_request_ids == f"cmpl-{RID}-0-deadbeef" and row.preempt_count == 1
    # past the answer, a call no engine saw is written once join_wait_s has passed
    other = "kvs" + "cd" * 16
    j.on_client(start(rid=other, ts=103.0))
    j.on_client(end(rid=other, ts=103.5))
    horizon[0] = 104.0
    ticking(j, clock, 4.9)
    assert rows(out)[-1].request_id != other
    ticking(j, clock, 0.2)
    assert rows(out)[-1].request_id == other and rows(out)[-1].engine_request_ids == ""
    # an engine that never reports again holds a row at most LATE_ROW_S more
    third = "kvs" + "ef" * 16
    j.on_client(start(rid=third, ts=105.0))
    j.on_client(end(rid=third, ts=106.0))
    ticking(j, clock, 5.0 + LATE_ROW_S - 0.2)
    assert rows(out)[-1].request_id != third
    ticking(j, clock, 0.3)
    assert rows(out)[-1].request_id == third


def test_a_trace_waits_for_its_client_then_goes_unjoined() -> None:
    clock = Clock()
    j, out = join(join_wait_s=5, clock=clock)
    j.on_client(start(rid="warm-up"))  # a middleware is talking to this sidecar
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef"))
    assert out == []
    j.on_client(start())
    j.tick()
    assert out and out[0].client_id == "team-a"  # type: ignore[attr-defined]
    other = "kvs" + "cd" * 16
    j.on_trace(trace(f"cmpl-{other}-0-deadbeef"))
    ticking(j, clock, 4.9)
    assert out[-1].client_id == "team-a"  # type: ignore[attr-defined]
    ticking(j, clock, 0.2)
    assert out[-1].client_id == "" and j.stats.unjoined_traces == 1  # type: ignore[attr-defined]


def test_without_a_middleware_traces_go_straight_out_uncounted() -> None:
    j, out = join()
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef"))
    j.on_trace(trace("r12"))
    assert len(out) == 2 and j.stats.unjoined_traces == 0 and not j.held


def test_an_id_reused_after_its_answer_joins_each_call_by_time() -> None:
    """A retry under the caller's own ID, after the first answer: each trace joins the
    call whose span holds its arrival, and each call's row counts its own preemptions."""
    j, out = join()
    j.on_client(start(rid="order-7", ts=100.0, call="c1"))
    j.on_client(end(rid="order-7", ts=101.0, call="c1", status=499))
    j.on_client(start(rid="order-7", ts=102.0, call="c2", prompt="p1"))
    j.on_trace(trace("cmpl-order-7-0-00000002", preempts=3, arrival=102.1))
    j.on_trace(trace("cmpl-order-7-0-00000001", preempts=1, arrival=100.1))  # late
    j.on_client(end(rid="order-7", ts=103.0, call="c2"))
    by_status = {r.http_status: r for r in rows(out)}
    assert by_status[499].engine_request_ids == "cmpl-order-7-0-00000001"
    assert by_status[499].preempt_count == 1
    assert by_status[200].engine_request_ids == "cmpl-order-7-0-00000002"
    assert by_status[200].preempt_count == 3 and by_status[200].duplicate
    assert j.stats.joined_traces == 2 and j.stats.unjoined_traces == 0


def test_concurrent_calls_under_one_id_are_counted_never_guessed() -> None:
    j, out = join()
    j.on_client(start(rid="dup", ts=100.0, client="team-a", call="c1"))
    j.on_client(start(rid="dup", ts=100.2, client="team-b", call="c2"))
    j.on_trace(trace("cmpl-dup-0-00000001", arrival=100.1))  # only c1 had started
    j.on_trace(trace("cmpl-dup-0-00000002", arrival=100.3))  # both open: either
    j.on_client(end(rid="dup", ts=101.0, call="c2", status=429))
    j.on_client(end(rid="dup", ts=101.5, call="c1"))
    j.flush()
    joined, unjoined = traces(out)
    assert joined.client_id == "team-a" and unjoined.client_id == ""
    assert (j.stats.joined_traces, j.stats.unjoined_traces, j.stats.ambiguous_traces) == (1, 1, 1)
    by_client = {r.client_id: r for r in rows(out)}  # each answer paired on its call_id
    assert by_client["team-a"].http_status == 200 and by_client["team-a"].preempt_count == 0
    assert by_client["team-b"].http_status == 429 and by_client["team-b"].preempt_count == -1


def test_an_oversized_id_joins_on_its_digest() -> None:
    huge = "x" * 5000 + "-0-deadbeef"
    key = request_key(huge)
    assert key.startswith("sha256:") and len(key) == 71 and request_key(RID) == RID
    j, out = join()
    j.on_client(start(rid=key))
    j.on_trace(trace(f"cmpl-{huge}-0-1a2b3c4d"))
    assert traces(out)[0].client_id == "team-a" and j.stats.joined_traces == 1


def test_one_id_reused_without_end_stays_bounded() -> None:
    j, out = join()
    for i in range(20_000):
        j.on_client(start(rid="same", ts=float(i), call=f"c{i}"))
    assert len(j.by_key["same"]) == MAX_SAME_KEY
    j.on_trace(trace("cmpl-same-0-00000001", arrival=30_000.0))  # every kept call spans it
    assert j.stats.ambiguous_traces == 1 and len(out) == 1
    j.on_client(end(rid="same", call="c0"))  # a call no longer indexed still answers
    j.flush()
    assert len(rows(out)) == 1 and rows(out)[0].preempt_count == -1


def test_a_resubmission_is_flagged_duplicate() -> None:
    j, out = join(duplicate_window_s=10)
    second = "kvs" + "cd" * 16
    third = "kvs" + "ef" * 16
    j.on_client(start())
    j.on_client(start(rid=second, ts=105.0))
    j.on_client(start(rid=third, ts=200.0))  # outside the window
    for rid in (RID, second, third):
        j.on_client(end(rid=rid, ts=201.0))
    j.flush()  # no engine trace came: rows are written when the join wait ends
    assert [r.duplicate for r in rows(out)] == [False, True, False]
    assert rows(out)[1].duplicate_of == RID
    assert j.stats.duplicates == {"team-a": 1}


def test_hostile_header_values_cannot_raise_cardinality() -> None:
    j, _ = join(max_clients=5, max_user_agents=3)
    for i in range(1000):
        rid = f"kvs{i:032x}"
        j.on_client(start(rid=rid, client=f"evil-{i}\n\x00", agent=f"bot/{i}"))
        j.on_client(end(rid=rid, ts=1.0))
    j.flush()
    assert len(j.stats.requests) == 6 and j.stats.requests["other"] == 995
    assert len(j.stats.agent_requests) == 4
    assert j.stats.clients.overflow == 995 and j.stats.agents.overflow == 997
    assert all(v.isprintable() for v in j.stats.requests)


def test_label_slots_sanitise_and_cap() -> None:
    slots = LabelSlots(1)
    assert slots("a\x00b" * 100) == ("ab" * 32)
    assert slots("z") == "other" and slots.overflow == 1


def test_preempt_rate_recommends_from_rate_and_free_blocks() -> None:
    hub = Hub()
    feed(hub, [hello(), step(), keyframe()], 0)
    st = hub.engines["0"]
    assert preempt_rate([st], 60)["recommendation"] == "ok"
    st.counters.ends["FINISHED_STOPPED"] = 100
    st.counters.preemptions["kv_full"] = 7
    r = preempt_rate([st], 60)
    assert (r["preemptions"], r["requests"], r["recommendation"]) == (7, 100, "backoff")
    st.counters.preemptions["kv_full"] = 20
    assert preempt_rate([st], 60)["recommendation"] == "shed"


def test_a_call_of_several_engine_requests_writes_its_row_with_all_of_them() -> None:
    """n = 2 samples: two engine requests of one call. The answer came after the first
    trace had joined, and the second (preempted twice) reached the sidecar after the
    answer: the row was written with the first alone (preempt_count 0). It now waits
    until every engine's records have passed the answer's time."""
    clock = Clock()
    horizon = [101.0]
    j, out = join(join_wait_s=5, clock=clock, horizon=lambda: horizon[0])
    j.on_client(start())
    j.on_trace(trace(f"0_cmpl-{RID}-0-aaaaaaaa", preempts=0))
    j.on_client(end(ts=102.0))
    ticking(j, clock, 1.0)
    assert not rows(out)
    j.on_trace(trace(f"1_cmpl-{RID}-0-bbbbbbbb", preempts=2))
    horizon[0] = 102.5
    j.tick()
    (row,) = rows(out)
    assert row.engine_request_ids == f"0_cmpl-{RID}-0-aaaaaaaa,1_cmpl-{RID}-0-bbbbbbbb"
    assert row.preempt_count == 2 and row.preempt_reason == "kv_full"
    # both traces joined before the answer, the engines already past it: written at once
    other = "kvs" + "cd" * 16
    j.on_client(start(rid=other, ts=103.0))
    j.on_trace(trace(f"0_cmpl-{other}-0-aaaaaaaa", preempts=1, arrival=103.1))
    j.on_trace(trace(f"1_cmpl-{other}-0-bbbbbbbb", preempts=1, arrival=103.1))
    horizon[0] = 104.5
    j.on_client(end(rid=other, ts=104.0))
    assert rows(out)[-1].request_id == other and rows(out)[-1].preempt_count == 2


def test_a_request_folded_into_other_is_counted_once() -> None:
    """The overflow counter counts requests folded into ``other``: each joined trace of
    a request counted it again, with or without a preemption."""
    j, out = join(max_clients=1, max_user_agents=1)
    for i, who in enumerate(("a", "b")):
        rid = f"kvs{i:032x}"
        j.on_client(start(rid=rid, client=who, agent=f"ua/{who}"))
        j.on_trace(trace(f"0_cmpl-{rid}-0-aaaaaaaa", preempts=1))
        j.on_trace(trace(f"1_cmpl-{rid}-0-bbbbbbbb", preempts=0))
        j.on_client(end(rid=rid))
    assert [r.client_id for r in rows(out)] == ["a", "b"]
    assert (j.stats.clients.overflow, j.stats.agents.overflow) == (1, 1)
    assert j.stats.preemptions == {"a": 1, "other": 1}


def test_a_long_call_keeps_its_row() -> None:
    """A call is kept until its answer however long it runs (a slow, much-preempted
    request is the one to see): calls were forgotten 600 s after their start, and such a
    call's answer found nothing (no row, its trace counted unjoined)."""
    clock = Clock()
    j, out = join(join_wait_s=5, clock=clock, keep_s=600)
    j.on_client(start(ts=100.0))
    ticking(j, clock, 650.0, every_s=1.0)
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=4, arrival=100.1))
    j.on_client(end(ts=750.0))
    (row,) = rows(out)
    assert row.preempt_count == 4 and j.stats.unjoined_traces == 0
    ticking(j, clock, 599.0, every_s=1.0)
    assert RID in j.by_key  # kept keep_s after its answer, for late traces
    ticking(j, clock, 2.0, every_s=1.0)
    assert not j.calls and not j.by_key


def test_a_trace_outside_the_only_calls_span_is_not_joined_to_it() -> None:
    """One call known under an ID and a trace of that ID that arrived before the call
    started (another caller's reuse, or a call the middleware does not see): it joined
    that call whatever its time, and its preemption was counted against that client."""
    clock = Clock()
    j, out = join(join_wait_s=5, clock=clock)
    j.on_client(start(ts=100.0))
    j.on_client(end(ts=105.0))
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=1, arrival=200.0))
    ticking(j, clock, 6.0)
    (t,) = traces(out)
    assert t.client_id == "" and j.stats.unjoined_traces == 1
    assert j.stats.preemptions == {}
