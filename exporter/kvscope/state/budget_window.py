"""Scheduled tokens over the token budget, over an engine's last seconds of steps.

Each step appends the engine's cumulative scheduled tokens and token budget with its time
(``BudgetWindow.add``); the utilization over a window is the growth of one over the
growth of the other, from the oldest step inside the window (the steps after a step
outside it, read from the newest) to the newest. Read once a second per engine by the
layout sampler, under the hub lock, and at every scrape: walking back over ~2,800 steps
(10 s at 280 steps a second) took ~0.85 ms after the sampler's rest. Steps' times are the
engine's wall clock, which may step back; while none did within the kept steps, the same
step is found by bisection (the predicate is then monotonic), else by the walk.
"""

from __future__ import annotations

from collections import deque

KEPT = 4096
"""Steps kept: at more than ~410 steps a second the window is shorter than 10 s."""


class BudgetWindow:
    """The last ``KEPT`` steps' (time, cumulative scheduled tokens, cumulative budget)."""

    __slots__ = ("steps", "_added", "_back_at")

    def __init__(self) -> None:
        self.steps: deque[tuple[float, int, int]] = deque(maxlen=KEPT)
        self._added = 0
        """Steps added so far."""
        self._back_at = -KEPT - 2
        """``_added`` when a step's time was earlier than the step before it."""

    def add(self, ts: float, scheduled: int, budget: int) -> None:
        w = self.steps
        if w and ts < w[-1][0]:
            self._back_at = self._added
        w.append((ts, scheduled, budget))
        self._added += 1

    def base(self, window_s: float) -> tuple[int, int] | None:
        """(scheduled, budget) at the oldest step of the unbroken run of newest steps no
        more than ``window_s`` older than the newest; None when there is none."""
        w = self.steps
        if not w:
            return None
        t_end = w[-1][0]
        if self._added - self._back_at > len(w) and window_s >= 0:
            # Times never go back among the kept steps: "within the window" holds for a
            # suffix, whose first step bisection finds (the newest is always in it).
            lo, hi = 0, len(w) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if t_end - w[mid][0] > window_s:
                    lo = mid + 1
                else:
                    hi = mid
            _, sch, bud = w[lo]
            return sch, bud
        return walk_base(w, window_s)

    def utilization(self, window_s: float) -> float | None:
        """Scheduled tokens / token budget over the window; None when the window's budget
        did not grow (one step, or none)."""
        base = self.base(window_s)
        if base is None:
            return None
        _, sched_end, budget_end = self.steps[-1]
        if budget_end == base[1]:
            return None
        return (sched_end - base[0]) / (budget_end - base[1])


def walk_base(w: deque[tuple[float, int, int]], window_s: float) -> tuple[int, int] | None:
    """``BudgetWindow.base`` by walking back from the newest step (any times)."""
    t_end = w[-1][0]
    base = None
    for t, sch, bud in reversed(w):
        if t_end - t > window_s:
            break
        base = (sch, bud)
    return base
