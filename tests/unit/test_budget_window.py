"""The token budget's utilization window finds the step the walk back from the newest
finds, by bisection while the steps' times never went back, for any times."""

from __future__ import annotations

import random

import pytest

from kvscope.state.budget_window import KEPT, BudgetWindow, walk_base


def times(rng: random.Random, n: int, back: float) -> list[float]:
    """Step times ~3.6 ms apart, repeating now and then, stepping back with chance ``back``."""
    t, out = 1.764e9 + rng.random(), []
    for _ in range(n):
        r = rng.random()
        if r < back:
            t -= rng.choice((0.001, 0.5, 20.0))  # the wall clock stepped back
        elif r > 0.97:
            pass  # two steps at the same time
        else:
            t += rng.expovariate(1 / 0.0036)
        out.append(t)
    return out


@pytest.mark.parametrize("back", [0.0, 0.0005, 0.01])
def test_the_base_step_is_the_walks(back: float) -> None:
    rng = random.Random(int(back * 1e4) + 7)
    bisected = 0
    for _ in range(40):
        w = BudgetWindow()
        sched = budget = 0
        for i, ts in enumerate(times(rng, rng.choice((5, 300, KEPT + 700)), back)):
            sched += rng.randint(0, 2048)
            budget += 2048
            w.add(ts, sched, budget)
            if i % 37 == 0 or rng.random() < 0.01:
                t_end = w.steps[-1][0]
                for window in (10.0, 0.0, 0.05, 3.0, t_end - w.steps[0][0],
                               t_end - w.steps[len(w.steps) // 2][0]):  # on a step exactly
                    assert w.base(window) == walk_base(w.steps, window), (i, window)
                bisected += w._added - w._back_at > len(w.steps)
    assert bisected > 100  # the bisection did run (not only the walk)


def test_utilization_is_the_growth_over_the_window() -> None:
    w = BudgetWindow()
    assert w.utilization(10.0) is None
    w.add(100.0, 10, 100)
    assert w.utilization(10.0) is None  # one step: no growth to divide
    w.add(105.0, 60, 200)
    w.add(111.0, 80, 300)
    assert w.utilization(10.0) == (80 - 60) / (300 - 200)  # 100.0 is 11 s old: outside
    assert w.utilization(11.0) == (80 - 10) / (300 - 100)
    w.add(110.5, 90, 400)  # the clock went back half a second: the walk decides
    assert w.base(10.0) == walk_base(w.steps, 10.0) == (60, 200)
