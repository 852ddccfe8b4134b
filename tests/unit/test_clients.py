"""Client correlation: joins, duplicates, bounded labels, the preempt-rate answer."""

from __future__ import annotations

from kvscope.sidecar.clients import ClientJoin, LabelSlots, external_id
from kvscope.sidecar.hub import Hub
from kvscope.sidecar.pressure import preempt_rate
from kvscope.sinks.rows import ClientRequest, RequestTrace
from kvscope_probe import wire
from tests.unit.test_hub import feed, keyframe
from tests.unit.test_wire import hello, step

RID = "kvs" + "ab" * 16


def start(rid: str = RID, client: str = "team-a", prompt: str = "p1", ts: float = 100.0,
          agent: str = "curl/8") -> wire.ClientStart:
    return wire.ClientStart(rid, ts, "completions", "tiny", client, agent, "", prompt, 10, 16)


def trace(engine_id: str, preempts: int = 0) -> RequestTrace:
    return RequestTrace(ts=1.0, model="tiny", engine="0", request_id=engine_id, prompt_len=4,
                        max_gen_len=16, output_len=16, required_blocks=1, allocated_blocks=1,
                        contiguous_allocated=True, block_fragments=1, preempt_count=preempts,
                        preempt_reason="kv_full" if preempts else "", recomputed_tokens=0,
                        cached_tokens=0, free_blocks_at_alloc=3,
                        max_contiguous_free_blocks_at_alloc=3, arrival_ts=0.5, queue_seconds=0.1,
                        first_token_seconds=0.2, e2e_seconds=0.5, finish_reason="FINISHED_STOPPED")


class Clock:
    """A settable stand-in for time.monotonic."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_engine_ids_of_vllm_032_embed_the_middleware_id() -> None:
    assert external_id(f"cmpl-{RID}-0-1a2b3c4d") == RID
    assert external_id(f"chatcmpl-{RID}-1a2b3c4d") == RID
    assert external_id(f"chatcmpl-{RID}_2-1a2b3c4d") == RID
    assert external_id("r12") is None and external_id(f"cmpl-{RID}") is None


def test_trace_joined_to_its_client_and_row_written_at_the_answer() -> None:
    out: list[object] = []
    j = ClientJoin(out.append)
    j.on_client(start())
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=2))
    j.on_client(wire.ClientEnd(RID, 101.0, 200, 0.9))
    t, row = out
    assert isinstance(t, RequestTrace) and t.client_id == "team-a" and t.prompt_hash == "p1"
    assert isinstance(row, ClientRequest)
    assert row.engine_request_ids == f"cmpl-{RID}-0-deadbeef" and row.preempt_count == 2
    assert j.stats.preemptions == {"team-a": 2} and j.stats.requests == {"team-a": 1}


def test_an_answer_before_its_trace_waits_for_the_join() -> None:
    out: list[object] = []
    clock = Clock()
    j = ClientJoin(out.append, join_wait_s=5, clock=clock)
    j.on_client(start())
    j.on_client(wire.ClientEnd(RID, 101.0, 200, 0.9))
    assert not [r for r in out if isinstance(r, ClientRequest)]
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef", preempts=1))
    (row,) = [r for r in out if isinstance(r, ClientRequest)]
    assert row.engine_request_ids == f"cmpl-{RID}-0-deadbeef" and row.preempt_count == 1
    other = "kvs" + "cd" * 16
    j.on_client(start(rid=other))
    j.on_client(wire.ClientEnd(other, 102.0, 200, 0.9))
    clock.t = 6
    j.tick()
    rows = [r for r in out if isinstance(r, ClientRequest)]
    assert rows[-1].request_id == other and rows[-1].preempt_count == -1


def test_a_trace_waits_for_its_client_then_goes_unjoined() -> None:
    out: list[object] = []
    clock = Clock()
    j = ClientJoin(out.append, join_wait_s=5, clock=clock)
    j.on_trace(trace(f"cmpl-{RID}-0-deadbeef"))
    assert out == []
    j.on_client(start())
    j.tick()
    assert out and out[0].client_id == "team-a"  # type: ignore[attr-defined]
    other = "kvs" + "cd" * 16
    j.on_trace(trace(f"cmpl-{other}-0-deadbeef"))
    clock.t = 6
    j.tick()
    assert out[-1].client_id == "" and j.stats.unjoined_traces == 1  # type: ignore[attr-defined]


def test_a_resubmission_is_flagged_duplicate() -> None:
    out: list[object] = []
    j = ClientJoin(out.append, duplicate_window_s=10)
    second = "kvs" + "cd" * 16
    third = "kvs" + "ef" * 16
    j.on_client(start())
    j.on_client(start(rid=second, ts=105.0))
    j.on_client(start(rid=third, ts=200.0))  # outside the window
    for rid in (RID, second, third):
        j.on_client(wire.ClientEnd(rid, 201.0, 200, 0.1))
    j.flush()  # no engine trace came: rows are written when the join wait ends
    rows = [r for r in out if isinstance(r, ClientRequest)]
    assert [r.duplicate for r in rows] == [False, True, False]
    assert rows[1].duplicate_of == RID
    assert j.stats.duplicates == {"team-a": 1}


def test_hostile_header_values_cannot_raise_cardinality() -> None:
    out: list[object] = []
    j = ClientJoin(out.append, max_clients=5, max_user_agents=3)
    for i in range(1000):
        rid = f"kvs{i:032x}"
        j.on_client(start(rid=rid, client=f"evil-{i}\n\x00", agent=f"bot/{i}"))
        j.on_client(wire.ClientEnd(rid, 1.0, 200, 0.1))
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
