"""The Hub accepts frames in order, goes stale on gaps, and survives anything."""

from __future__ import annotations

import time

from kvscope.state.hub import Hub
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
