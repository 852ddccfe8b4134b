"""The layout sampler: each engine's pool sampled at a bounded rate, kept in memory.

Only a synced ledger is sampled; a stale one is reported as stale, never drawn from
guesses. Snapshots themselves are built in ``layout_snapshot``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from kvscope.layout.snapshot import (
    EngineCopy,
    Layout,
    Owner,
    Snapshot,
    build_snapshot,
    decode_runs,
    encode_runs,
)
from kvscope.os_thread import name_os_thread
from kvscope.state.hub import Hub

__all__ = ["LayoutSampler", "Owner", "Point", "Snapshot", "decode_runs", "encode_runs"]

log = logging.getLogger("kvscope.sidecar")


@dataclass(frozen=True)
class Point:
    """One sparkline sample; figures are None while the ledger is stale."""

    ts: float
    free_blocks: int | None
    max_contiguous_free: int | None
    budget_utilization: float | None


class LayoutSampler:
    """Samples every engine of a Hub at most once per ``interval_s`` and keeps history.

    ``tick()`` does one round (tests call it directly); ``start()`` runs it on a daemon
    thread. Per engine it keeps up to ``history`` snapshots within ``history_bytes`` (so a
    128k-block pool keeps fewer) and ``history`` sparkline points. ``subscribe(fn)`` gets
    every new snapshot (a ClickHouse sink: ``fn = lambda s: [emit(r) for r in layout_rows(s)]``,
    ``layout_rows`` from ``kvscope.layout.history``).
    """

    def __init__(self, hub: Hub, interval_s: float = 1.0, history: int = 600,
                 history_bytes: int = 64 << 20) -> None:
        if interval_s <= 0 or history < 1 or history_bytes < 1:
            raise ValueError("interval_s, history and history_bytes must be positive")
        self.hub = hub
        self.interval_s = interval_s
        self.history = history
        self.history_bytes = history_bytes
        self.lock = threading.RLock()
        self._snaps: dict[str, deque[Snapshot]] = {}
        self._bytes: dict[str, int] = {}
        self._points: dict[str, deque[Point]] = {}
        self._stale: dict[str, bool] = {}
        self._due: dict[str, float] = {}
        self._keys: dict[str, tuple[Any, ...]] = {}
        self._subscribers: list[Callable[[Snapshot], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, fn: Callable[[Snapshot], None]) -> None:
        self._subscribers.append(fn)

    # -- sampling -------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[Snapshot]:
        """Sample each engine whose interval has passed; returns the new snapshots."""
        now = time.time() if now is None else now
        copies: list[tuple[tuple[Any, ...], EngineCopy]] = []
        stale: list[str] = []
        unchanged: list[str] = []
        with self.hub.lock:
            for name, st in self.hub.engines.items():
                if now < self._due.get(name, float("-inf")):
                    continue
                self._due[name] = now + self.interval_s
                if not st.ledger.synced:
                    stale.append(name)
                    continue
                c = st.counters
                key = (st.hello.session, c.steps, c.gaps, c.ledger_mismatches)
                if self._keys.get(name) == key:
                    unchanged.append(name)
                    continue
                copies.append((key, EngineCopy.of(st)))
        new = [build_snapshot(c, now) for _, c in copies]
        with self.lock:
            for (key, _), snap in zip(copies, new, strict=True):
                self._keys[snap.key] = key
            for name in unchanged:  # an idle engine: same pool, new time, no new bytes
                ring = self._snaps.get(name)
                if ring:
                    new.append(replace(ring[-1], ts=now, cost=0))
            for name in stale:
                self._stale[name] = True
                self._keys.pop(name, None)
                self._points_of(name).append(Point(now, None, None, None))
            for snap in new:
                self._keep(snap)
        for snap in new:
            for fn in self._subscribers:
                try:
                    fn(snap)
                except Exception:  # noqa: BLE001 - one bad subscriber must not starve others
                    log.exception("layout subscriber %r failed", fn)
        return new

    def _points_of(self, name: str) -> deque[Point]:
        return self._points.setdefault(name, deque(maxlen=self.history))

    def _keep(self, snap: Snapshot) -> None:
        name = snap.key
        self._stale[name] = False
        ring = self._snaps.setdefault(name, deque())
        ring.append(snap)
        self._bytes[name] = self._bytes.get(name, 0) + snap.cost
        if snap.cost and not snap.layout.is_built:  # its build, when read, is counted too
            snap.layout.grew = partial(self._grew, name)
        self._trim(name)
        self._points_of(name).append(Point(snap.ts, snap.free_blocks,
                                           snap.max_contiguous_free, snap.budget_utilization))

    def _grew(self, name: str, layout: Layout, added: int) -> None:
        """A kept snapshot's runs and owners were built (read): ``added`` bytes more."""
        with self.lock:
            if layout.grew is None:  # it left the history before its build was done
                return
            layout.grew = None
            layout.charged = added
            self._bytes[name] += added
            self._trim(name)

    def _trim(self, name: str) -> None:
        ring = self._snaps[name]
        while len(ring) > 1 and (len(ring) > self.history
                                 or self._bytes[name] > self.history_bytes):
            old = ring.popleft()
            if old.cost:  # the one that counted its layout's bytes (an idle copy does not)
                self._bytes[name] -= old.cost + old.layout.charged
                old.layout.grew = None

    # -- reading ------------------------------------------------------------------------
    def latest(self, engine: str) -> Snapshot | None:
        with self.lock:
            ring = self._snaps.get(engine)
            return ring[-1] if ring else None

    def is_stale(self, engine: str) -> bool:
        """True when the last attempt found the ledger out of sync."""
        with self.lock:
            return self._stale.get(engine, False)

    def points(self, engine: str) -> list[Point]:
        with self.lock:
            return list(self._points.get(engine, ()))

    def snapshots(self, engine: str, since: float, until: float) -> list[Snapshot]:
        with self.lock:
            return [s for s in self._snaps.get(engine, ()) if since <= s.ts <= until]

    def oldest_ts(self, engine: str) -> float | None:
        """Time of the oldest snapshot still held in memory for this engine."""
        with self.lock:
            snaps = self._snaps.get(engine)
            return snaps[0].ts if snaps else None

    # -- thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvscope-layout", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        name_os_thread()
        while not self._stop.wait(min(self.interval_s, 1.0) / 4):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bad sample must not end sampling
                log.exception("layout sampling failed")

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
