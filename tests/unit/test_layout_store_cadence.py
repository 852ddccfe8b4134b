"""Which layout samples reach the store (kvscope.layout.store_cadence)."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.layout.snapshot import Layout, Snapshot
from kvscope.layout.store_cadence import StoreCadence


def snap(ts: float, step: int, preemptions: int = 0, session: str = "a",
         engine: str = "0") -> Snapshot:
    return Snapshot(engine=engine, model="m", session=session, ts=ts, step=step, step_ts=0.0,
                    num_blocks=8, kv_groups=(), layout=Layout.of(np.zeros((0, 4), np.int32), ()),
                    free_blocks=8, cached_blocks=0, used_blocks=0, max_contiguous_free=8,
                    budget_utilization=None, running=0, waiting=0, preemptions=preemptions)


def kept(cadence: StoreCadence, samples: list[Snapshot]) -> list[tuple[float, int]]:
    return [(s.ts, s.step) for x in samples for s in cadence.pick(x)]


def test_a_busy_pool_is_kept_once_an_interval() -> None:
    samples = [snap(float(t), 100 * t) for t in range(31)]  # one a second, always changing
    assert kept(StoreCadence(10.0), samples) == [(0.0, 0), (10.0, 1000), (20.0, 2000),
                                                 (30.0, 3000)]


def test_an_unchanged_pool_is_kept_once_in_the_idle_period() -> None:
    samples = [snap(float(t), 5) for t in range(0, 901)]  # no step for 15 minutes
    assert kept(StoreCadence(10.0, idle_s=300.0), samples) == [(0.0, 5), (300.0, 5),
                                                               (600.0, 5), (900.0, 5)]


def test_both_samples_around_a_preemption_are_kept() -> None:
    samples = [snap(0.0, 0), snap(1.0, 100), snap(2.0, 200), snap(3.0, 300, preemptions=2),
               snap(4.0, 400, preemptions=2), snap(5.0, 500, preemptions=3),
               snap(6.0, 600, preemptions=3)]
    # 2.0 before the first preemptions and 3.0 after; 4.0 before the next and 5.0; the
    # rest wait for the interval
    assert kept(StoreCadence(10.0, pair_gap_s=2.0), samples) == [(0.0, 0), (2.0, 200), (3.0, 300),
                                                 (4.0, 400), (5.0, 500)]


def test_a_preemption_right_after_a_kept_sample_keeps_it_once() -> None:
    samples = [snap(0.0, 0), snap(1.0, 100, preemptions=1), snap(2.0, 200, preemptions=4)]
    assert kept(StoreCadence(10.0, pair_gap_s=0.0), samples) == [(0.0, 0), (1.0, 100),
                                                                 (2.0, 200)]


def test_a_preemption_storm_keeps_one_pair_per_gap() -> None:
    # a preemption between every two samples for 25 s
    samples = [snap(float(t), 100 * t, preemptions=t) for t in range(26)]
    assert kept(StoreCadence(60.0, pair_gap_s=10.0), samples) == [
        (0.0, 0), (1.0, 100), (10.0, 1000), (11.0, 1100), (20.0, 2000), (21.0, 2100)]


def test_a_new_session_and_each_engine_start_their_own_cadence() -> None:
    c = StoreCadence(10.0)
    samples = [snap(0.0, 10), snap(0.0, 10, engine="1"), snap(1.0, 20),
               snap(2.0, 3, session="b"),  # the engine restarted: its first sample is kept
               snap(2.0, 20, preemptions=5, engine="1"),  # engine 1 preempted: both kept
               snap(3.0, 4, preemptions=9, session="b")]  # a new session counts from 0
    out = [(s.engine, s.session, s.ts) for x in samples for s in c.pick(x)]
    assert out == [("0", "a", 0.0), ("1", "a", 0.0), ("0", "b", 2.0), ("1", "a", 2.0),
                   ("0", "b", 3.0)]


def test_an_interval_longer_than_the_idle_period_holds_for_idle_pools_too() -> None:
    samples = [snap(float(t), 5) for t in range(0, 1201, 100)]
    assert kept(StoreCadence(600.0, idle_s=300.0), samples) == [(0.0, 5), (600.0, 5),
                                                                (1200.0, 5)]


def test_bad_intervals_are_refused() -> None:
    for interval, idle, gap in ((0.0, 300.0, 1.0), (10.0, 0.0, 1.0), (-1.0, 300.0, 1.0),
                                (10.0, 300.0, -1.0)):
        with pytest.raises(ValueError):
            StoreCadence(interval, idle_s=idle, pair_gap_s=gap)
