"""A sliding window of request outcomes, as a client can really observe them.

What a client can and cannot see
--------------------------------
vLLM's OpenAI API never tells a client that its request was preempted: a preempted
request is recomputed inside the engine and still answers 200, only later. So the
outcomes here are limited to what reaches the client:

- ``ok``: a 2xx answer with no preemption reported for it.
- ``preempted``: a 2xx answer whose ``x-kvscope-preempted`` header (a count a kvscope
  middleware may add; no released middleware sets it yet) is above zero. Without that
  header the only preemption signal is the sidecar's server-wide
  ``/health/preempt-rate``, which is not a per-request outcome and is kept apart
  (:mod:`kvscope.client.preempt_rate`).
- ``overloaded``: an answer of 429, 503 or 504, or a connect, read or write timeout: the
  server (or a proxy in front of it) refused or could not serve in time. A pool timeout
  (this client's own connections all busy) is an ``error``, not the server's load.
- ``error``: anything else that failed (other 4xx / 5xx, connection refused, a broken
  response). It is counted but is not pressure: a bad request says nothing about load.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

Outcome = Literal["ok", "preempted", "overloaded", "error"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
BAD: frozenset[Outcome] = frozenset({"preempted", "overloaded"})
"""Outcomes that count as pressure."""


@dataclass(frozen=True)
class WindowRates:
    """Counts and rates over the last ``window_s`` seconds."""

    window_s: float
    requests: int
    """Outcomes recorded in the window (each attempt, retries included)."""
    counts: dict[str, int]
    """Outcomes by kind; every kind present, zeros included."""

    def rate(self, *kinds: Outcome) -> float | None:
        """Share of the window's outcomes of the given kinds; None for an empty window."""
        if not self.requests:
            return None
        return sum(self.counts[k] for k in kinds) / self.requests

    @property
    def preempted_rate(self) -> float | None:
        return self.rate("preempted")

    @property
    def overload_rate(self) -> float | None:
        return self.rate("overloaded")

    @property
    def bad_rate(self) -> float | None:
        """Preempted or overloaded, over all outcomes."""
        return self.rate(*BAD)


class SlidingWindow:
    """Outcomes of the last ``window_s`` seconds of ``clock`` time.

    Memory is one entry per outcome in the window; counts are kept incrementally so a
    read costs only the pruning of expired entries.
    """

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, Outcome]] = deque()
        self._counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)

    def record(self, outcome: Outcome) -> None:
        """Add one outcome at the current clock time."""
        if outcome not in self._counts:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        now = self._clock()
        self._prune(now)
        self._events.append((now, outcome))
        self._counts[outcome] += 1

    def rates(self) -> WindowRates:
        """Counts and rates of the outcomes recorded in (now - window_s, now]."""
        self._prune(self._clock())
        return WindowRates(self.window_s, len(self._events), dict(self._counts))

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        events = self._events
        while events and events[0][0] <= horizon:
            _, old = events.popleft()
            self._counts[old] -= 1
