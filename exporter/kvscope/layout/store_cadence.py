"""Which layout samples the store keeps: a row is a whole pool (40.7 KB compressed at 32k
blocks with 256 running, benchmarks/store_disk.py), so one a second was 3.4 GB per busy
engine-day, and 0.5 GB for a day of an idle engine.

Kept, per engine: the first sample of a session; a sample whose pool changed once
``interval_s`` has passed since the last kept one; an unchanged pool once ``idle_s`` (or
``interval_s``, if longer) has passed (so a dashboard's window still finds the pool as it
stood); and, whenever the engine preempted between two samples, both of them (the pool just
before and just after, which is what ``kvscope explain`` shows for a preemption), at most
one such pair in ``pair_gap_s``. The live page and the sampler's own history keep every
sample.
"""

from __future__ import annotations

from kvscope.layout.snapshot import Snapshot

IDLE_S = 300.0
"""An unchanged pool is stored this often."""
PAIR_GAP_S = 10.0
"""The samples around a preemption are kept at most this often (a storm preempts every
step: kept whole, it would be a row a second again)."""


class StoreCadence:
    """Picks the samples to store; ``pick`` is called with every new sample, in order."""

    def __init__(self, interval_s: float, idle_s: float = IDLE_S,
                 pair_gap_s: float = PAIR_GAP_S) -> None:
        if not (interval_s > 0 and idle_s > 0 and pair_gap_s >= 0):
            raise ValueError("interval_s and idle_s must be positive, pair_gap_s not negative")
        self.interval_s, self.idle_s = interval_s, max(idle_s, interval_s)
        self.pair_gap_s = pair_gap_s
        # per engine key, as the sampler's own maps (bounded by the engines it has seen)
        self._prev: dict[str, Snapshot] = {}
        """Each engine's previous sample."""
        self._kept: dict[str, Snapshot] = {}
        """Each engine's last stored sample."""
        self._paired: dict[str, float] = {}
        """When each engine's last preemption pair was kept."""

    def pick(self, snap: Snapshot) -> list[Snapshot]:
        key = snap.key
        prev, kept = self._prev.get(key), self._kept.get(key)
        self._prev[key] = snap
        out: list[Snapshot] = []
        if (prev is not None and prev.session == snap.session
                and snap.preemptions > prev.preemptions
                and snap.ts - self._paired.get(key, float("-inf")) >= self.pair_gap_s):
            if prev is not kept:
                out.append(prev)
            out.append(snap)
            self._paired[key] = snap.ts
        elif kept is None or kept.session != snap.session:
            out.append(snap)
        else:
            changed = kept.step != snap.step
            if snap.ts - kept.ts >= (self.interval_s if changed else self.idle_s):
                out.append(snap)
        if out:
            self._kept[key] = out[-1]
        return out
