"""The Hub accepts frames in order, goes stale on gaps, and survives anything."""

from __future__ import annotations

import logging
import time
from unittest import mock

import pytest

from kvscope.state.hub import FORGET_GONE_S, HORIZON_HEARD_TICKS, Hub
from kvscope_probe import wire
from tests.unit.test_wire import frame, hello, step


def keyframe(n: int = 8, session: str = "s1") -> wire.Keyframe:
    return wire.Keyframe(hello=hello(num_blocks=n, session=session),
                         states=bytes([3] + [0] * (n - 1)), tables={}, tokens={})


def feed(hub: Hub, records: list[wire.Record], first_seq: int, session: str = "s1") -> bool:
    f = wire.Frame(engine="0", session=session, first_seq=first_seq, dropped=0, faults=0,
                   records=records)
    return hub.accept(wire.encode(f))


def test_frames_in_order_keep_the_ledger_exact() -> None:
    hub = Hub()
    assert feed(hub, [hello(), step(free_blocks=7), keyframe()], 0)
    st = hub.engines["0"]
    assert st.ledger.synced and st.ledger.free == 7
    pre = wire.Preemption("v", 1, 0, 64, 5, 1, "r", 0, 6, "fcfs", "kv_full", 1.0)
    assert feed(hub, [step(ops=[(wire.OP_ALLOC, [1, 2]), (wire.OP_FREE, [1])],
                           free_blocks=6, preemptions=[pre], preempted=["v"])], 3)
    assert st.ledger.synced and st.ledger.free == 6
    assert st.counters.preemptions["kv_full"] == 1
    seen = st.recent_preemptions[-1]
    assert seen.max_contiguous_free == 5  # after op 0 only (1, 2 taken): run 3..7
    assert st.counters.preempted_tokens == 64


def test_a_gap_makes_the_ledger_stale_until_the_next_keyframe() -> None:
    hub = Hub()
    feed(hub, [hello(), step(), keyframe()], 0)
    st = hub.engines["0"]
    feed(hub, [step()], 5)  # seq 3 and 4 never arrived
    assert not st.ledger.synced and st.counters.gaps == 1
    feed(hub, [step(), keyframe()], 6)
    assert st.ledger.synced


def test_a_free_count_disagreement_is_a_mismatch_and_goes_stale() -> None:
    hub = Hub()
    feed(hub, [hello(), step(), keyframe()], 0)
    feed(hub, [step(free_blocks=3)], 3)
    st = hub.engines["0"]
    assert st.counters.ledger_mismatches == 1 and not st.ledger.synced


def test_bad_input_is_counted_and_the_hub_keeps_going() -> None:
    hub = Hub()
    assert not hub.accept([b"nope"])
    assert not hub.accept([wire.VERSION_TAG, b"\x93\x01"])
    assert not feed(hub, [step()], 0)  # unknown session, no hello yet
    feed(hub, [hello(), step(), keyframe()], 0)
    assert not feed(hub, [step(ops=[(wire.OP_ALLOC, [999])])], 3)  # block outside the pool
    assert hub.rejected == {"parts": 1, "malformed": 1, "unknown_session": 1, "invalid": 1}
    assert not hub.engines["0"].ledger.synced
    assert feed(hub, [step(), keyframe()], 4)
    assert hub.engines["0"].ledger.synced


def test_a_new_session_replaces_a_silent_engine_state() -> None:
    hub = Hub(health_timeout_s=0.05)
    feed(hub, [hello(), step(), keyframe()], 0)
    hub.engines["0"].counters.preemptions["kv_full"] = 5
    time.sleep(0.1)  # the old session fell silent: the new one is the engine restarted
    assert feed(hub, [step(), keyframe(session="s2")], 7, session="s2")
    st = hub.engines["0"]
    assert st.hello.session == "s2" and st.counters.preemptions["kv_full"] == 0
    assert list(hub.engines) == ["0"] and not hub.collisions
    _ = frame


def test_a_step_that_sends_the_same_list_is_read_against_the_one_before() -> None:
    """Wire version 3: ``cached_same`` steps reuse the previous step's ``cached_ids``; after
    a missed frame the list is unknown, the ledger says stale (no error, the frame's other
    facts kept) until a keyframe and the whole list again."""
    hub = Hub()
    kf = wire.Keyframe(hello=hello(num_blocks=10), states=bytes([3, 2, 2] + [0] * 7),
                       tables={"a": [[1]], "b": [[2]]}, tokens={"a": 10, "b": 20})
    assert feed(hub, [hello(num_blocks=10), kf], 0)
    st = hub.engines["0"]
    whole = step(cached_ids=["a", "b"], cached_computed=[10, 20], scheduled_counts=[1, 1],
                 free_blocks=7)
    same = step(cached_same=True, cached_computed=[11, 21], scheduled_counts=[1, 1],
                free_blocks=7)
    assert feed(hub, [whole, same], 2)
    assert st.ledger.synced and st.ledger.tokens == {"a": 12, "b": 22}
    assert st.last_step is not None and st.last_step.cached_ids == ["a", "b"]
    assert wire.scheduled_tokens_of(st.last_step) == {"a": 1, "b": 1}
    # records 4 and 5 never arrive: "the same" cannot be read, and nothing is refused
    end = wire.End("a", "FINISHED_STOPPED", 8, 4, 0, 0, 3.0)
    assert feed(hub, [step(cached_same=True, cached_computed=[14, 24],
                           scheduled_counts=[1, 1], free_blocks=7, ends=[end])], 6)
    assert not st.ledger.synced and st.counters.gaps == 1
    assert st.counters.ends == {"FINISHED_STOPPED": 1}  # the record's other facts kept
    assert feed(hub, [kf, step(cached_ids=["a", "b"], cached_computed=[30, 40],
                               scheduled_counts=[1, 1], free_blocks=7)], 7)
    assert st.ledger.synced and st.ledger.tokens == {"a": 31, "b": 41}
    # a forged "same" whose counts do not fit the list is refused with a reason
    assert not feed(hub, [step(cached_same=True, cached_computed=[1], scheduled_counts=[1],
                               free_blocks=7)], 9)
    assert hub.rejected["invalid"] == 1


def test_a_step_that_sends_its_list_as_an_edit_is_read_against_the_one_before() -> None:
    """Wire version 4: ``cached_removed`` steps take positions out of the previous step's
    list and append ``cached_ids``; the counts follow (the one taken out keeps its last);
    after a missed frame the edit cannot be read (stale, facts kept), and positions outside
    the list before are refused with a reason."""
    hub = Hub()
    kf = wire.Keyframe(hello=hello(num_blocks=10), states=bytes([3, 2, 2, 2] + [0] * 6),
                       tables={"a": [[1]], "b": [[2]], "c": [[3]]},
                       tokens={"a": 10, "b": 20, "c": 30})
    assert feed(hub, [hello(num_blocks=10), kf], 0)
    st = hub.engines["0"]
    whole = step(cached_ids=["a", "b"], cached_computed=[10, 20], scheduled_counts=[1, 1],
                 free_blocks=6)
    edit = step(cached_removed=[0], cached_ids=["c"], cached_computed=[21, 30],
                scheduled_counts=[1, 2], free_blocks=6)
    grown = step(cached_removed=[], cached_ids=["a"], cached_computed=[22, 32, 11],
                 scheduled_counts=[1, 1, 1], free_blocks=6)
    assert feed(hub, [whole, edit, grown], 2)
    assert st.ledger.synced and st.last_step is not None
    assert st.last_step.cached_ids == ["b", "c", "a"] and st.last_step.cached_removed is None
    assert st.ledger.tokens == {"a": 12, "b": 23, "c": 33}
    assert wire.scheduled_tokens_of(st.last_step) == {"b": 1, "c": 1, "a": 1}
    # record 5 never arrives: the edit of record 6 has nothing to edit
    end = wire.End("a", "FINISHED_STOPPED", 8, 4, 0, 0, 3.0)
    assert feed(hub, [step(cached_removed=[2], cached_ids=[], cached_computed=[40, 50],
                           scheduled_counts=[1, 1], free_blocks=6, ends=[end])], 6)
    assert not st.ledger.synced and st.counters.gaps == 1
    assert st.counters.ends == {"FINISHED_STOPPED": 1}
    assert feed(hub, [kf, step(cached_ids=["a", "b"], cached_computed=[60, 70],
                               scheduled_counts=[1, 1], free_blocks=6)], 7)
    assert st.ledger.synced and st.ledger.tokens["b"] == 71
    for seq, removed in ((9, [2]), (12, [1, 0])):  # outside the list before, not ascending
        assert not feed(hub, [step(cached_removed=removed, cached_ids=[],
                                   cached_computed=[1], scheduled_counts=[1],
                                   free_blocks=6)], seq)
        assert feed(hub, [kf, step(cached_ids=["a", "b"], cached_computed=[60, 70],
                                   scheduled_counts=[1, 1], free_blocks=6)], seq + 1)
        assert st.ledger.synced
    assert hub.rejected["invalid"] == 2


def test_a_refused_frame_leaves_the_same_list_unknown_not_wrong() -> None:
    """A frame refused part-way (its sequence numbers counted, so no gap follows) loses the
    list its later steps carried: a "same" step after it is read as unknown (stale, its
    facts kept), not against an older list (which refused every frame until a keyframe)."""
    hub = Hub()
    kf = wire.Keyframe(hello=hello(num_blocks=10), states=bytes([3, 2, 2] + [0] * 7),
                       tables={"a": [[1]], "b": [[2]]}, tokens={"a": 10, "b": 20})
    assert feed(hub, [hello(num_blocks=10), kf], 0)
    st = hub.engines["0"]
    one = step(cached_ids=["a"], cached_computed=[10], scheduled_counts=[1], free_blocks=7)
    bad = step(cached_same=True, cached_computed=[11], scheduled_counts=[1],
               ops=[(wire.OP_ALLOC, [99])], free_blocks=7)  # a block outside the pool
    two = step(cached_ids=["a", "b"], cached_computed=[12, 20], scheduled_counts=[1, 1],
               free_blocks=7)  # never read: the frame stops at ``bad``
    assert not feed(hub, [one, bad, two], 2)
    assert hub.rejected["invalid"] == 1
    end = wire.End("b", "FINISHED_STOPPED", 8, 4, 0, 0, 3.0)
    assert feed(hub, [step(cached_same=True, cached_computed=[13, 21],
                           scheduled_counts=[1, 1], free_blocks=7, ends=[end])], 5)
    assert hub.rejected["invalid"] == 1 and not st.ledger.synced
    assert st.counters.ends == {"FINISHED_STOPPED": 1}


def test_the_record_horizon_is_where_every_connected_engine_has_reported() -> None:
    """What ``ClientJoin`` waits for before it writes an answered call's row: the latest
    step's or heartbeat's time of each connected engine, the least of them."""
    hub = Hub(health_timeout_s=30.0)
    assert hub.record_horizon() == float("inf")  # no engine: nothing to wait for
    feed(hub, [hello(), step(ts=10.0), keyframe()], 0)
    assert hub.record_horizon() == 10.0
    one = wire.Frame(engine="1", session="s2", first_seq=0, dropped=0, faults=0,
                     records=[hello(engine="1", session="s2"), step(ts=12.0)])
    assert hub.accept(wire.encode(one)) and len(hub.engines) == 2
    assert hub.record_horizon() == 10.0  # engine 1 is further on
    beat = wire.Frame(engine="0", session="s1", first_seq=3, dropped=0, faults=0,
                      records=[wire.Heartbeat(ts=13.0, since_step_s=3.0)])
    assert hub.accept(wire.encode(beat))  # engine 0 idle: its heartbeat moves it on
    assert hub.record_horizon() == 12.0
    for _ in range(HORIZON_HEARD_TICKS):
        hub.tick()
    beat = wire.Frame(engine="0", session="s1", first_seq=3, dropped=0, faults=0,
                      records=[wire.Heartbeat(ts=14.0, since_step_s=4.0)])
    assert hub.accept(wire.encode(beat))
    hub.tick()  # engine 1 has not been heard for HORIZON_HEARD_TICKS + 1: nobody waits for it
    assert hub.record_horizon() == 14.0
    for _ in range(HORIZON_HEARD_TICKS + 1):
        hub.tick()
    assert hub.record_horizon() == float("inf")


def test_an_engine_not_heard_for_three_heartbeats_holds_nobody_back() -> None:
    """A live probe is heard at least every heartbeat period (its sender's heartbeat, on
    its own thread, steps or not). One not heard for three periods of the sidecar's ticks,
    still inside the health timeout (a replayed engine, a stalled probe), has nothing on
    its way to wait for; a sidecar that did not tick (its ingest thread descheduled) has
    not given it that time, however long the wall clock says it was."""
    hub = Hub(health_timeout_s=30.0)
    feed(hub, [hello(), step(ts=10.0), keyframe()], 0)
    presence = hub.presence["s1"]
    presence.last_heard -= 20.0  # 20 s without a word, and no tick: a stalled sidecar
    assert hub.record_horizon() == 10.0
    for _ in range(HORIZON_HEARD_TICKS):
        hub.tick()
    assert hub.record_horizon() == 10.0
    hub.tick()
    assert hub.state_of(hub.engines["0"]) == "active"  # connected, but not heard lately
    assert hub.record_horizon() == float("inf")
    feed(hub, [step(ts=11.0)], 3)  # it speaks again: it counts again
    assert hub.record_horizon() == 11.0
    presence.gone = True  # its process was seen to exit: nothing more comes from it
    assert hub.record_horizon() == float("inf")


def test_the_horizon_looks_no_process_up() -> None:
    """It runs at every tick while a row waits, on the ingest thread: the presence's own
    figures only, never psutil."""
    hub = Hub(health_timeout_s=30.0)
    feed(hub, [hello(), step(ts=10.0), keyframe()], 0)
    hub.presence["s1"].local = True  # a PID it could look up

    def no_lookup(*_a: object, **_k: object) -> bool:
        raise AssertionError("record_horizon looked a process up")

    with mock.patch("kvscope.state.presence.process_gone", no_lookup):
        assert hub.record_horizon() == 10.0


def _scrape(hub: Hub) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvscope.sidecar.exposition.metrics import KVScopeCollector
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub))
    return generate_latest(reg).decode()


def test_a_hello_whose_pool_cannot_exist_is_refused_and_every_scrape_still_works() -> None:
    bad = [dict(block_size=0), dict(block_size=-16),
           dict(kv_groups=[wire.KVGroup("FullAttentionSpec", 0)]),
           dict(kv_groups=[wire.KVGroup("FullAttentionSpec", 32),
                           wire.KVGroup("SlidingWindowSpec", -1)]),
           dict(num_blocks=0), dict(num_blocks=-3),
           # a 100-byte hello must not make the sidecar allocate a huge ledger
           dict(num_blocks=(1 << 25) + 1),
           dict(kv_groups=[wire.KVGroup("FullAttentionSpec", 32)] * 65)]
    hub = Hub()
    assert feed(hub, [hello(), keyframe(), step()], 0)
    for i, kw in enumerate(bad):
        h = hello(session=f"bad{i}", engine=f"b{i}", **kw)
        f = wire.Frame(engine=f"b{i}", session=f"bad{i}", first_seq=0, dropped=0, faults=0,
                       records=[h, step(waiting=1, head_req_id="x", head_blocks_needed=5)])
        assert not hub.accept(wire.encode(f)), kw
    assert hub.rejected == {"invalid": len(bad)}
    assert list(hub.engines) == ["0"] and list(hub.sessions) == ["s1"]
    assert list(hub.presence) == ["s1"]
    assert 'kvscope_probe_frames_rejected_total{reason="invalid"} 8.0' in _scrape(hub)


def test_a_block_id_outside_the_pool_in_a_table_is_refused_and_never_stored() -> None:
    hub = Hub()
    assert feed(hub, [hello(), keyframe(), step()], 0)
    led = hub.engines["0"].ledger
    seq = 3
    bad_steps = [
        step(new_reqs=[wire.NewReq("r", [[2**63]], 0)], num_scheduled={"r": 1}),
        step(new_reqs=[wire.NewReq("r", [[1, -5]], 0)], num_scheduled={"r": 2}),
        step(new_reqs=[wire.NewReq("r", [[8]], 0)], num_scheduled={"r": 1}),  # pool of 8
    ]
    for s in bad_steps:
        assert not feed(hub, [s], seq)
        seq += 1
        assert "r" not in led.tables and not led.synced
        assert feed(hub, [step(), keyframe()], seq)  # back in sync
        seq += 2
    # a running request's table grows by an ID outside the pool
    assert feed(hub, [step(new_reqs=[wire.NewReq("g", [[1]], 0)], num_scheduled={"g": 1},
                           ops=[(wire.OP_ALLOC, [1])], free_blocks=6)], seq)
    seq += 1
    assert led.synced and led.tables == {"g": [[1]]}
    for ids in ([2**64 - 1], [2, -1]):
        assert not feed(hub, [step(cached_ids=["g"], cached_computed=[1], num_scheduled={"g": 1},
                                   grown_ids=["g"], grown_blocks=[[ids]], free_blocks=6)], seq)
        seq += 1
        assert led.tables["g"] == [[1]] and not led.synced
    # and a keyframe's tables
    kf = wire.Keyframe(hello=hello(), states=bytes([3, 2] + [0] * 6), tables={"k": [[1, 9]]},
                       tokens={"k": 40})
    assert not feed(hub, [kf], seq)
    assert "k" not in led.tables and not led.synced
    assert hub.rejected == {"invalid": 6}


def test_every_colliding_probe_gets_its_own_engine_and_all_expire(
        caplog: pytest.LogCaptureFixture) -> None:
    hub = Hub()
    sessions = [f"abcdef{i:02d}" for i in range(11)]  # one holder, ten collisions
    with caplog.at_level(logging.WARNING, logger="kvscope.sidecar"):
        for s in sessions:
            h = hello(session=s, server="srv", pid=7)
            f = wire.Frame(engine="0", session=s, first_seq=0, dropped=0, faults=0,
                           records=[h, keyframe(session=s)])
            assert hub.accept(wire.encode(f))
    assert len(hub.engines) == 11 and len(hub.sessions) == 11 and len(hub.presence) == 11
    for s, st in hub.sessions.items():  # each session's state is the engine under its key
        assert hub.engines[st.key] is st and st.hello.session == s
    assert hub.collisions == {("srv", "0"): 10}
    warned = [r for r in caplog.records if "two live probes claim" in r.getMessage()]
    assert len(warned) == 2  # the 1st and the 10th (kvscope.throttle)
    for p in hub.presence.values():
        p.last_heard -= FORGET_GONE_S + 10
    hub.tick()
    assert hub.engines == {} and hub.sessions == {} and hub.presence == {}


def test_listeners_are_told_when_the_hub_forgets_an_engine() -> None:
    from kvscope.state.requests import RequestTracker
    rows: list[object] = []
    tracker = RequestTracker(rows.append)
    hub = Hub()
    events: list[tuple[str, str]] = []
    hub.listeners.append(tracker.on_event)
    hub.listeners.append(lambda kind, st, _p: events.append((kind, st.key)))
    arrivals = [wire.Arrival(f"r{i}", 10, 10, 0, 1.0) for i in range(5)]
    new = wire.NewReq("r0", [[1]], 0)
    assert feed(hub, [hello(), keyframe(), step(arrivals=arrivals, new_reqs=[new],
                                               num_scheduled={"r0": 10},
                                               ops=[(wire.OP_ALLOC, [1])], free_blocks=6)], 0)
    assert len(tracker.live["0"]) == 5 and "0" in tracker.config_due
    for p in hub.presence.values():
        p.last_heard -= FORGET_GONE_S + 10
    hub.tick()
    assert hub.engines == {}
    assert events[-1] == ("forget", "0")
    for held in (tracker.live, tracker.prefilling, tracker.allocations, tracker.config_due,
                 tracker.rollups.seconds, tracker.rollups.never_fit_head):
        assert "0" not in held


def test_a_listener_that_fails_on_forget_does_not_stop_the_hub() -> None:
    hub = Hub()

    def broken(kind: str, _st: object, _p: object) -> None:
        if kind == "forget":
            raise RuntimeError("boom")

    hub.listeners.append(broken)
    assert feed(hub, [hello(), keyframe()], 0)
    for p in hub.presence.values():
        p.last_heard -= FORGET_GONE_S + 10
    hub.tick()
    assert hub.engines == {} and hub.sessions == {} and hub.presence == {}


def test_the_hub_holds_at_most_max_engines_and_refuses_the_rest() -> None:
    hub = Hub()
    with mock.patch("kvscope.state.hub.MAX_ENGINES", 3):
        for i in range(5):
            h = hello(engine=f"e{i}", session=f"s{i}")
            f = wire.Frame(engine=f"e{i}", session=f"s{i}", first_seq=0, dropped=0, faults=0,
                           records=[h, keyframe(session=f"s{i}")])
            assert hub.accept(wire.encode(f)) == (i < 3)
        assert sorted(hub.engines) == ["e0", "e1", "e2"] and len(hub.sessions) == 3
        assert len(hub.presence) == 3
        assert hub.rejected == {"too_many_engines": 2}
        # a restarted engine replaces its own state: no more engines for that
        hub.presence["s1"].last_heard -= 3600
        h = hello(engine="e1", session="s1b")
        f = wire.Frame(engine="e1", session="s1b", first_seq=0, dropped=0, faults=0,
                       records=[h, keyframe(session="s1b")])
        assert hub.accept(wire.encode(f))
        assert hub.engines["e1"].hello.session == "s1b" and len(hub.engines) == 3
    assert 'kvscope_probe_frames_rejected_total{reason="too_many_engines"} 2.0' in _scrape(hub)


class _CountingList(list):  # type: ignore[type-arg]
    """A list that counts membership tests (each one a scan of the list)."""

    scans = 0

    def __contains__(self, item: object) -> bool:
        _CountingList.scans += 1
        return super().__contains__(item)


def test_resumed_requests_are_looked_up_once_per_step_not_once_per_growth() -> None:
    from kvscope.state.requests import RequestTracker
    hub = Hub()
    tracker = RequestTracker(lambda _row: None)
    hub.listeners.append(tracker.on_event)
    assert feed(hub, [hello(), keyframe(),
                      step(new_reqs=[wire.NewReq("a", [[1]], 0)], num_scheduled={"a": 1},
                           arrivals=[wire.Arrival("a", 1, 1, 0, 1.0)],
                           ops=[(wire.OP_ALLOC, [1])], free_blocks=6)], 0)
    st = hub.engines["0"]
    k = 300  # one request grown k times, k other requests resumed
    resumed = _CountingList(f"x{i}" for i in range(k))
    s = step(cached_ids=["a"], cached_computed=[1], num_scheduled={"a": 1},
             grown_ids=["a"] * k, grown_blocks=[[[]]] * k, resumed=resumed, free_blocks=6)
    _CountingList.scans = 0
    st.ingest(s)
    assert _CountingList.scans == 0  # a set built once, by the ledger and by the tracker
    assert st.ledger.tables["a"] == [[1]] and st.ledger.synced


def test_probe_strings_outside_known_sets_share_one_other_label() -> None:
    from kvscope_probe.fingerprint import FEATURES
    hub = Hub()
    disabled = {"ends": "no hook", **{f"f{i}": "x" for i in range(40)}}
    assert feed(hub, [hello(disabled=disabled), keyframe()], 0)
    known = ["FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED",
             "FINISHED_IGNORED", "FINISHED_ERROR", "FINISHED_REPETITION"]
    ends = [wire.End(f"r{i}", status, 1, 1, 0, 0, 1.0)
            for i, status in enumerate(known + [f"S{j}" for j in range(500)])]
    assert feed(hub, [step(ends=ends)], 2)
    st = hub.engines["0"]
    assert st.counters.ends == {**dict.fromkeys(known, 1), "other": 500}
    text = _scrape(hub)
    ended = [ln for ln in text.splitlines()
             if ln.startswith("vllm_scheduler_requests_ended_total{")]
    assert len(ended) == 7 and any('status="other"} 500.0' in ln for ln in ended)
    off = [ln for ln in text.splitlines() if ln.startswith("kvscope_probe_feature_disabled{")]
    assert len(off) == 2
    assert any('feature="ends"' in ln for ln in off) and any('feature="other"' in ln for ln in off)
    assert "ends" in FEATURES
    # a hello listing more features than any probe has is refused
    h = hello(session="s2", engine="e2", disabled={f"g{i}": "" for i in range(65)})
    f = wire.Frame(engine="e2", session="s2", first_seq=0, dropped=0, faults=0, records=[h])
    assert not hub.accept(wire.encode(f)) and hub.rejected == {"invalid": 1}


def test_a_replayed_frame_is_refused_before_anything_is_applied() -> None:
    hub = Hub()
    assert feed(hub, [hello(), keyframe()], 0)
    st = hub.engines["0"]
    pre = wire.Preemption("v", 1, 0, 64, 7, 0, None, None, None, "fcfs", "kv_full", 1.0)
    dup = step(preemptions=[pre], preempted=["v"], scheduled_tokens=10)
    assert feed(hub, [dup], 2)
    assert not feed(hub, [dup], 2) and not feed(hub, [dup], 2)
    assert st.counters.steps == 1 and st.counters.preemptions["kv_full"] == 1
    assert st.counters.scheduled_tokens == 10 and st.counters.gaps == 0
    assert st.ledger.synced and st.next_seq == 3
    assert feed(hub, [step(ops=[(wire.OP_ALLOC, [1, 2, 3])], free_blocks=4)], 3)
    assert not feed(hub, [hello(), keyframe()], 0)  # frame 0 again: not a reset
    assert st.ledger.free == 4 and st.ledger.synced and st.next_seq == 4
    assert hub.rejected == {"invalid": 3}
    beat = wire.Frame(engine="0", session="s1", first_seq=1, dropped=0, faults=0,
                      records=[wire.Heartbeat(2.0, 0.5)])
    assert hub.accept(wire.encode(beat))  # heartbeats stand outside the sequence
    assert feed(hub, [step(free_blocks=4)], 4) and st.ledger.synced


def test_a_keyframe_with_unknown_states_or_no_null_block_is_refused() -> None:
    hub = Hub()
    assert feed(hub, [hello(), keyframe()], 0)
    led = hub.engines["0"].ledger
    bad = [bytes(8), bytes([3, 0, 0, 0, 4, 0, 0, 0]), bytes([3, 0, 3, 0, 0, 0, 0, 0]),
           bytes([2] + [0] * 7)]
    for seq, states in enumerate(bad, start=2):
        kf = wire.Keyframe(hello=hello(), states=states, tables={}, tokens={})
        assert not feed(hub, [kf], seq)
        assert led.free == 7 and led.used == 0 and led.states == bytearray(keyframe().states)
    assert hub.rejected == {"invalid": 4}
    first = wire.Frame(engine="1", session="s9", first_seq=0, dropped=0, faults=0,
                       records=[wire.Keyframe(hello=hello(engine="1", session="s9"),
                                              states=bytes(8), tables={}, tokens={})])
    assert not hub.accept(wire.encode(first))  # its hello is fine: the engine waits, stale
    assert not hub.engines["1"].ledger.synced and hub.engines["1"].ledger.used == 0


def test_a_step_with_negative_counts_or_a_non_finite_time_is_refused_whole() -> None:
    hub = Hub()
    assert feed(hub, [hello(), keyframe()], 0)
    st = hub.engines["0"]
    c = st.counters
    pre = wire.Preemption("v", 1, 0, -10**15, 7, 0, None, None, None, "fcfs", "kv_full", 1.0)
    bad = [step(scheduled_tokens=-5), step(token_budget=-1), step(schedule_ns=-10**12),
           step(probe_ns=-1), step(preemptions=[pre], preempted=["v"]),
           step(ts=float("nan"), ops=[(wire.OP_ALLOC, [1])], free_blocks=6),
           step(ts=float("inf"))]
    for seq, s in enumerate(bad, start=2):
        assert not feed(hub, [s], seq)
    assert (c.steps, c.scheduled_tokens, c.budget_tokens, c.preempted_tokens) == (0, 0, 0, 0)
    assert c.schedule_seconds == 0.0 and c.probe_seconds == 0.0
    assert c.preemptions["kv_full"] == 0 and st.ledger.free == 7  # no op applied
    assert hub.rejected == {"invalid": len(bad)}


def test_a_frame_naming_another_engine_leaves_the_session_owner_in_sync() -> None:
    hub = Hub()
    assert feed(hub, [hello(), keyframe()], 0)
    st = hub.engines["0"]
    for records in ([wire.Heartbeat(1.0, 0.0)], [step()]):
        f = wire.Frame(engine="other", session="s1", first_seq=2, dropped=0, faults=0,
                       records=records)
        assert not hub.accept(wire.encode(f))
        assert st.ledger.synced
    assert hub.rejected == {"invalid": 2}
