"""Property tests of the circuit breaker: random calls, results and clock advances.

A reference model, written from the specification and fed only the breaker's public
events, checks after every step:
- it never admits a request while OPEN before the deadline the model computes itself
  (base duration, times the factor per failed probe, capped);
- HALF_OPEN admits at most ``half_open_probes`` probes (in flight + succeeded);
- the state only changes by CLOSED->OPEN, OPEN->HALF_OPEN, HALF_OPEN->CLOSED/OPEN, and each
  transition starts from the state the model holds;
- every evaluation window's counts equal the outcomes the test recorded in [start, end),
  its verdict follows the threshold rule, and CLOSED->OPEN happens only right after
  ``open_after_windows`` consecutive, contiguous bad windows.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvscope.client import CircuitBreaker, CircuitOpenError, ClientConfig
from kvscope.client.breaker import TRANSITIONS, Permit, Transition, WindowVerdict
from tests.client.fakes import FakeClock

OUTCOMES = st.sampled_from(["ok", "ok", "preempted", "overloaded", "error"])
SERVER_RATE = st.none() | st.sampled_from([0.0, 0.05, 0.1, 0.11, 0.25, 0.5, 0.6])
STEP = st.sampled_from(
    [0.0, 0.1, 0.25, 0.4, 0.9, 1.0, 1.9, 3.9, 4.9, 5.0, 9.9, 29.9, 59.9, 60.0, 61.0, 200.0]
) | st.floats(0, 130)
"""Clock steps; many land just before an open deadline or a window's end."""


class BreakerMachine(RuleBasedStateMachine):
    @initialize(windows=st.integers(1, 4), probes=st.integers(1, 3),
                min_samples=st.integers(1, 4), window_s=st.sampled_from([10.0, 60.0]),
                open_s=st.sampled_from([0.5, 1.0, 5.0]), factor=st.sampled_from([1.0, 2.0, 3.0]),
                cap=st.sampled_from([1.0, 4.0, 30.0]),
                threshold=st.sampled_from([0.1, 0.25, 0.5]))
    def setup(self, windows: int, probes: int, min_samples: int, window_s: float,
              open_s: float, factor: float, cap: float, threshold: float) -> None:
        self.cfg = ClientConfig(open_after_windows=windows, half_open_probes=probes,
                                open_threshold=threshold,
                                min_samples=min_samples, window_s=window_s,
                                open_duration_s=open_s, open_backoff_factor=factor,
                                max_open_duration_s=max(cap, open_s))
        self.clock = FakeClock(0.0)
        self.events: list[WindowVerdict | Transition] = []
        self.breaker = CircuitBreaker(self.cfg, self.clock, observer=self.events.append)
        self.state = "closed"
        self.generation = 0
        self.duration = open_s
        self.deadline = 0.0
        self.in_flight: list[Permit] = []
        self.probes_out = self.probe_successes = 0
        self.log: list[tuple[float, str, float | None]] = []
        self.verdicts: list[WindowVerdict] = []
        self.window_start = 0.0

    # --- rules -------------------------------------------------------------------------
    @rule(dt=STEP)
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @rule(count=st.integers(1, 3))
    def send(self, count: int) -> None:
        for _ in range(count):
            try:
                permit = self.breaker.acquire()
            except CircuitOpenError as exc:
                self.sync()
                assert exc.retry_after_s >= 0
                assert self.state == "open" or (
                    self.state == "half_open"
                    and self.probes_out + self.probe_successes >= self.cfg.half_open_probes)
                continue
            self.sync()
            assert not (self.state == "open"), "admitted while open"
            if permit.probe:
                assert self.state == "half_open" and permit.generation == self.generation
                self.probes_out += 1
                assert self.probes_out + self.probe_successes <= self.cfg.half_open_probes
            else:
                assert self.state == "closed"
            self.in_flight.append(permit)

    @precondition(lambda self: self.state == "open")
    @rule(early=st.sampled_from([0.0, 1e-6, 0.1]))
    def to_open_deadline(self, early: float) -> None:
        """Step to (just before) the deadline the model expects the circuit to half-open."""
        self.clock.now = max(self.clock.now, self.deadline - early)

    @precondition(lambda self: self.state == "closed")
    @rule(early=st.sampled_from([0.0, 1e-6, 0.1]))
    def to_window_end(self, early: float) -> None:
        """Step to (just before) the end of the current evaluation window."""
        self.clock.now = max(self.clock.now, self.window_start + self.cfg.window_s - early)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), outcome=OUTCOMES, server_rate=SERVER_RATE)
    def finish(self, data: st.DataObject, outcome: str, server_rate: float | None) -> None:
        index = data.draw(st.integers(0, len(self.in_flight) - 1))
        self.complete(self.in_flight.pop(index), outcome, server_rate)

    @rule(count=st.integers(1, 12), outcome=OUTCOMES, server_rate=SERVER_RATE)
    def burst(self, count: int, outcome: str, server_rate: float | None) -> None:
        """Requests sent and answered one after another, all alike."""
        for _ in range(count):
            self.send(1)
            if self.in_flight:
                self.complete(self.in_flight.pop(), outcome, server_rate)

    def complete(self, permit: Permit, outcome: str, server_rate: float | None) -> None:
        closed = self.breaker.state == "closed"
        self.sync()
        current_probe = permit.probe and self.state == "half_open" and \
            permit.generation == self.generation
        self.breaker.record(permit, outcome, server_rate)  # type: ignore[arg-type]
        if not permit.probe and closed:
            self.log.append((self.clock(), outcome, server_rate))
        if current_probe:
            self.probes_out -= 1
            good = outcome == "ok" and not (server_rate is not None
                                            and server_rate > self.cfg.open_threshold)
            self.probe_successes += good
        self.sync()

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        permit = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        if permit.probe and self.breaker.state == "half_open" \
                and permit.generation == self.generation:
            self.probes_out -= 1
        self.breaker.release(permit)
        self.sync()

    # --- the model -----------------------------------------------------------------------
    def sync(self) -> None:
        while self.events:
            event = self.events.pop(0)
            if isinstance(event, WindowVerdict):
                self.check_verdict(event)
            else:
                self.check_transition(event)

    def check_verdict(self, v: WindowVerdict) -> None:
        assert self.state == "closed" and v.start < v.end <= self.clock()
        if self.verdicts:
            assert v.start == self.verdicts[-1].end, "windows must be contiguous"
        inside = [(o, r) for t, o, r in self.log if v.start <= t < v.end]
        bad = sum(o in ("preempted", "overloaded") for o, _ in inside)
        rates = [r for _, r in inside if r is not None]
        assert (v.requests, v.bad) == (len(inside), bad)
        assert v.server_rate == (max(rates) if rates else None)
        thr = self.cfg.open_threshold
        expected = (len(inside) >= self.cfg.min_samples and bad / len(inside) > thr) or (
            bool(rates) and max(rates) > thr)
        assert v.is_bad == expected
        self.verdicts.append(v)
        self.window_start = v.end

    def check_transition(self, t: Transition) -> None:
        assert (t.old, t.new) in TRANSITIONS and t.old == self.state
        assert t.at == self.clock()
        event(f"{t.old} -> {t.new}")
        if t.new == "open":
            if t.old == "closed":
                k = self.cfg.open_after_windows
                last = self.verdicts[-k:]
                assert len(last) == k and all(v.is_bad for v in last)
                self.duration = self.cfg.open_duration_s
            else:
                assert self.probes_out + self.probe_successes <= self.cfg.half_open_probes
                self.duration = min(self.cfg.max_open_duration_s,
                                    self.duration * self.cfg.open_backoff_factor)
            self.deadline = t.at + self.duration
        elif t.new == "half_open":
            assert t.at >= self.deadline, "left OPEN before the deadline"
            self.generation += 1
            self.probes_out = self.probe_successes = 0
        else:
            assert self.probe_successes == self.cfg.half_open_probes
            self.duration = self.cfg.open_duration_s
            self.verdicts, self.log = [], []
            self.window_start = t.at
        self.state = t.new

    @invariant()
    def agrees_with_the_model(self) -> None:
        if not hasattr(self, "breaker"):
            return
        snap = self.breaker.snapshot()
        self.sync()
        assert snap.state == self.state
        if self.state == "open":
            assert self.clock() < self.deadline
            assert snap.retry_after_s == pytest.approx(self.deadline - self.clock())
            assert snap.open_duration_s == pytest.approx(self.duration)
        else:
            assert snap.retry_after_s == 0.0


BreakerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_breaker_state_machine = BreakerMachine.TestCase
