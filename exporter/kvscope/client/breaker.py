"""The circuit breaker's state machine: pure, clock-injected, no I/O.

CLOSED: requests pass. Outcomes are counted in consecutive evaluation windows of
``window_s`` seconds, anchored at construction (and restarted on closing). A window is bad
when its own bad rate is above ``open_threshold`` with at least ``min_samples`` outcomes,
or when a server-reported preemption rate seen during it is above ``open_threshold``. A
window without enough evidence is not bad and breaks the streak. ``open_after_windows``
consecutive bad windows open the circuit.

OPEN: :meth:`CircuitBreaker.acquire` raises :class:`CircuitOpenError` until the open
duration has passed, then the breaker is HALF_OPEN.

HALF_OPEN: ``half_open_probes`` requests are let through. Any probe that comes back bad
(or while the server still reports a rate above the threshold) re-opens the circuit for a
longer time (times ``open_backoff_factor``, capped at ``max_open_duration_s``); once all
probes succeeded the circuit closes and the open duration is reset. A probe that ended in a
plain ``error`` (no evidence about load) frees its slot for another probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvscope.client.config import ClientConfig
from kvscope.client.errors import CircuitOpenError
from kvscope.client.window import BAD, Outcome

State = Literal["closed", "open", "half_open"]
TRANSITIONS: frozenset[tuple[State, State]] = frozenset({
    ("closed", "open"), ("open", "half_open"), ("half_open", "closed"), ("half_open", "open"),
})


@dataclass(frozen=True)
class Permit:
    """Leave to send one request; hand it back to :meth:`CircuitBreaker.record`."""

    probe: bool
    generation: int


@dataclass(frozen=True)
class WindowVerdict:
    """One closed evaluation window, [start, end) in clock time."""

    start: float
    end: float
    requests: int
    bad: int
    server_rate: float | None
    is_bad: bool


@dataclass(frozen=True)
class Transition:
    at: float
    old: State
    new: State
    reason: str


@dataclass(frozen=True)
class BreakerSnapshot:
    state: State
    consecutive_bad_windows: int
    retry_after_s: float
    """Seconds until a request may pass again (0 when closed)."""
    open_duration_s: float
    opens_total: int
    rejected_total: int
    """Requests refused locally with CircuitOpenError."""


class CircuitBreaker:
    """See the module docstring. Not thread-safe: the caller serialises access."""

    def __init__(self, config: ClientConfig, clock: Callable[[], float],
                 observer: Callable[[WindowVerdict | Transition], None] | None = None) -> None:
        self._cfg = config
        self._clock = clock
        self._observer = observer
        self._state: State = "closed"
        self._generation = 0
        self._streak = 0
        self._open_until = 0.0
        self._open_duration = config.open_duration_s
        self._open_reason = ""
        self._in_flight = 0
        self._successes = 0
        self.opens_total = 0
        self.rejected_total = 0
        self._window_start = 0.0
        self._requests = 0
        self._bad = 0
        self._server_rate: float | None = None
        self._start_window(clock())

    @property
    def state(self) -> State:
        self._advance(self._clock())
        return self._state

    def acquire(self) -> Permit:
        """A permit to send now, or :class:`CircuitOpenError` (nothing must be sent)."""
        now = self._clock()
        self._advance(now)
        if self._state == "closed":
            return Permit(False, self._generation)
        if self._state == "open":
            self.rejected_total += 1
            raise CircuitOpenError(self._open_until - now, self._open_reason)
        if self._in_flight + self._successes < self._cfg.half_open_probes:
            self._in_flight += 1
            return Permit(True, self._generation)
        self.rejected_total += 1
        raise CircuitOpenError(self._open_duration,
                               f"{self._open_reason}; waiting for the half-open probe")

    def record(self, permit: Permit, outcome: Outcome,
               server_rate: float | None = None) -> None:
        """The outcome of a permitted request, and the server's preemption rate if known."""
        now = self._clock()
        self._advance(now)
        if permit.probe:
            self._record_probe(now, permit, outcome, server_rate)
        elif self._state == "closed":
            self._requests += 1
            self._bad += outcome in BAD
            if server_rate is not None:
                self._server_rate = max(self._server_rate or 0.0, server_rate)
        # a non-probe result arriving while open / half-open is not evidence for a probe

    def release(self, permit: Permit) -> None:
        """Give back a permit whose request never produced an outcome (e.g. cancelled)."""
        if permit.probe and self._state == "half_open" and permit.generation == self._generation:
            self._in_flight -= 1

    def snapshot(self) -> BreakerSnapshot:
        now = self._clock()
        self._advance(now)
        wait = max(0.0, self._open_until - now) if self._state == "open" else 0.0
        return BreakerSnapshot(self._state, self._streak, wait, self._open_duration,
                               self.opens_total, self.rejected_total)

    def _record_probe(self, now: float, permit: Permit, outcome: Outcome,
                      server_rate: float | None) -> None:
        if self._state != "half_open" or permit.generation != self._generation:
            return  # a probe of an earlier half-open period
        self._in_flight -= 1
        if outcome == "error":
            return
        thr = self._cfg.open_threshold
        if outcome in BAD:
            self._open(now, f"the half-open probe came back {outcome}", grow=True)
        elif server_rate is not None and server_rate > thr:
            self._open(now, f"the server still reports {_per_request(server_rate)} "
                            f"(above {thr:.2f})", grow=True)
        else:
            self._successes += 1
            if self._successes >= self._cfg.half_open_probes:
                self._move(now, "closed", "half-open probes succeeded")
                self._open_duration = self._cfg.open_duration_s
                self._streak = 0
                self._start_window(now)

    def _advance(self, now: float) -> None:
        if self._state == "open" and now >= self._open_until:
            self._generation += 1
            self._in_flight = self._successes = 0
            self._move(now, "half_open", "open duration elapsed")
        elif self._state == "closed":
            self._roll(now)

    def _roll(self, now: float) -> None:
        w = self._cfg.window_s
        while self._state == "closed" and now >= self._window_start + w:
            end = self._window_start + w
            if self._requests == 0 and self._server_rate is None and now >= end + w:
                end += math.floor((now - end) / w) * w  # one verdict for an idle stretch
            self._close_window(now, end)

    def _close_window(self, now: float, end: float) -> None:
        cfg = self._cfg
        own = self._bad / self._requests if self._requests >= cfg.min_samples else None
        server = self._server_rate
        is_bad = (own is not None and own > cfg.open_threshold) or (
            server is not None and server > cfg.open_threshold)
        self._emit(WindowVerdict(self._window_start, end, self._requests, self._bad,
                                 server, is_bad))
        self._streak = self._streak + 1 if is_bad else 0
        self._start_window(end)
        if self._streak >= cfg.open_after_windows:
            last = [f"the server's {_per_request(server)}"] if server is not None else []
            if own is not None:
                last.append(f"its own calls {own:.1%} preempted or overloaded")
            self._open(now, f"preemption/overload rate above {cfg.open_threshold:.0%} for "
                            f"{self._streak} consecutive {cfg.window_s:g} s windows "
                            f"(last: {'; '.join(last)})", grow=False)

    def _open(self, now: float, reason: str, grow: bool) -> None:
        if grow:
            self._open_duration = min(self._cfg.max_open_duration_s,
                                      self._open_duration * self._cfg.open_backoff_factor)
        self._open_until = now + self._open_duration
        self._streak = 0
        self.opens_total += 1
        self._open_reason = reason
        self._move(now, "open", reason)

    def _move(self, now: float, new: State, reason: str) -> None:
        old, self._state = self._state, new
        self._emit(Transition(now, old, new, reason))

    def _start_window(self, start: float) -> None:
        self._window_start = start
        self._requests = 0
        self._bad = 0
        self._server_rate = None

    def _emit(self, event: WindowVerdict | Transition) -> None:
        if self._observer is not None:
            self._observer(event)


def _per_request(rate: float) -> str:
    """The server's rate as what it is: preemptions per request ended in its window (it
    can pass 1), not a share of requests."""
    if rate == math.inf:  # PreemptRateReading.per_ended_request: none ended
        return "preemptions and no request ended"
    return f"{rate:.2f} preemptions per ended request"
