"""The breaker's state machine on hand-picked sequences (properties: test_breaker_props)."""

from __future__ import annotations

import pytest

from kvscope.client import CircuitBreaker, CircuitOpenError, ClientConfig
from kvscope.client.breaker import Permit, Transition, WindowVerdict
from tests.client.fakes import FakeClock


def breaker(**overrides: object) -> tuple[CircuitBreaker, FakeClock, list[object]]:
    clock = FakeClock(0.0)
    events: list[object] = []
    cfg = ClientConfig(**{"min_samples": 1, **overrides})  # type: ignore[arg-type]
    return CircuitBreaker(cfg, clock, observer=events.append), clock, events


def bad_window(b: CircuitBreaker, clock: FakeClock, start: float, n: int = 10) -> None:
    for i in range(n):
        clock.now = start + i
        b.record(b.acquire(), "overloaded" if i < 2 else "ok")


def open_it(b: CircuitBreaker, clock: FakeClock) -> None:
    for k in range(3):
        bad_window(b, clock, 60.0 * k)
    clock.now = 180.0
    assert b.state == "open"


def test_three_consecutive_bad_windows_open() -> None:
    b, clock, events = breaker()
    open_it(b, clock)
    verdicts = [e for e in events if isinstance(e, WindowVerdict)]
    assert [(v.start, v.end, v.requests, v.bad, v.is_bad) for v in verdicts] == [
        (0.0, 60.0, 10, 2, True), (60.0, 120.0, 10, 2, True), (120.0, 180.0, 10, 2, True)]
    (t,) = [e for e in events if isinstance(e, Transition)]
    assert (t.old, t.new, t.at) == ("closed", "open", 180.0)
    with pytest.raises(CircuitOpenError) as exc:
        b.acquire()
    assert exc.value.retry_after_s == 1.0


def test_an_idle_window_breaks_the_streak() -> None:
    b, clock, events = breaker()
    bad_window(b, clock, 0.0)
    bad_window(b, clock, 60.0)
    bad_window(b, clock, 240.0)  # 120-240 idle
    clock.now = 300.0
    assert b.state == "closed" and b.snapshot().consecutive_bad_windows == 1
    idle = [e for e in events if isinstance(e, WindowVerdict) and e.requests == 0]
    assert [(v.start, v.end) for v in idle] == [(120.0, 240.0)]


def test_windows_with_too_few_outcomes_are_not_bad() -> None:
    b, clock, _ = breaker(min_samples=20)
    for k in range(4):
        bad_window(b, clock, 60.0 * k)
    clock.now = 240.0
    assert b.state == "closed"


def server_windows(b: CircuitBreaker, clock: FakeClock, rate: float) -> None:
    """Three 60 s windows of one good call each, the server reporting ``rate``."""
    for k in range(3):
        clock.now = 60.0 * k
        b.record(b.acquire(), "ok", server_rate=rate)
    clock.now = 180.0


def test_server_rate_makes_a_window_bad() -> None:
    b, clock, _ = breaker()
    server_windows(b, clock, 0.11)
    assert b.state == "open"


def test_the_server_rate_is_said_as_preemptions_per_ended_request() -> None:
    # /health/preempt-rate's rate is preemptions per request ended in its window: it can
    # pass 1, and as a percentage ("118.8%") it read as a share gone wrong
    b, clock, events = breaker()
    server_windows(b, clock, 1.188)
    assert b.state == "open"
    (t,) = [e for e in events if isinstance(e, Transition)]
    assert t.reason == ("preemption/overload rate above 10% for 3 consecutive 60 s windows "
                        "(last: the server's 1.19 preemptions per ended request; its own "
                        "calls 0.0% preempted or overloaded)")
    clock.advance(1.0)
    b.record(b.acquire(), "ok", server_rate=1.188)
    t = [e for e in events if isinstance(e, Transition)][-1]
    assert (t.new, t.reason) == ("open", "the server still reports 1.19 preemptions per "
                                         "ended request (above 0.10)")


def test_the_own_share_is_said_alone_without_a_server_rate() -> None:
    b, clock, events = breaker()
    open_it(b, clock)
    (t,) = [e for e in events if isinstance(e, Transition)]
    assert t.reason == ("preemption/overload rate above 10% for 3 consecutive 60 s windows "
                        "(last: its own calls 20.0% preempted or overloaded)")


def test_half_open_admits_n_probes_and_closes_only_when_all_succeed() -> None:
    b, clock, _ = breaker(half_open_probes=2)
    open_it(b, clock)
    clock.advance(1.0)
    p1, p2 = b.acquire(), b.acquire()
    assert p1.probe and p2.probe and b.state == "half_open"
    with pytest.raises(CircuitOpenError, match="waiting for the half-open probe"):
        b.acquire()
    b.record(p1, "ok")
    assert b.state == "half_open"
    with pytest.raises(CircuitOpenError):
        b.acquire()  # one success + one in flight fill the two slots
    b.record(p2, "ok")
    assert b.state == "closed" and b.snapshot().open_duration_s == 1.0


def test_a_probe_error_or_release_frees_its_slot() -> None:
    b, clock, _ = breaker()
    open_it(b, clock)
    clock.advance(1.0)
    b.record(b.acquire(), "error")  # connection refused: no evidence about load
    assert b.state == "half_open"
    b.release(b.acquire())  # cancelled
    probe = b.acquire()
    b.record(probe, "preempted")
    assert b.state == "open" and b.snapshot().retry_after_s == 2.0


def test_a_stale_probe_and_late_results_change_nothing() -> None:
    b, clock, _ = breaker()
    open_it(b, clock)
    clock.advance(1.0)
    old_probe = b.acquire()
    b.record(old_probe, "overloaded")  # re-open for 2 s
    clock.advance(2.0)
    new_probe = b.acquire()
    b.record(old_probe, "ok")  # a duplicate report of the earlier generation
    b.record(Permit(False, 0), "ok")  # a request sent before the circuit opened
    assert b.state == "half_open"
    b.record(new_probe, "ok")
    assert b.state == "closed"


def test_closing_restarts_the_windows_and_resets_the_duration() -> None:
    b, clock, events = breaker()
    open_it(b, clock)
    clock.now = 181.0
    b.record(b.acquire(), "overloaded")
    clock.now = 183.5
    b.record(b.acquire(), "ok")
    assert b.state == "closed"
    events.clear()
    clock.now = 243.0
    assert b.state == "closed"
    assert not events  # the first window after closing runs 183.5 - 243.5
    clock.now = 243.5
    b.state  # noqa: B018 - reading the state rolls the window
    (v,) = events
    assert isinstance(v, WindowVerdict) and (v.start, v.end) == (183.5, 243.5)
