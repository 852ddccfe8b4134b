"""Requests' block allocations, collected per request and written as arrays.

One ``Allocations`` per engine; ``at`` sets the step the next allocations belong to, ``add``
appends one allocation to its request's open run,
``flush`` writes a request's run as one ``RequestAllocations`` row (at its preemption or
end), ``flush_due`` every open run once ``FLUSH_EVERY_S`` of engine time has passed since
the last, ``flush_all`` all of them (engine restart, shutdown). Times are kept as the
store keeps them, in milliseconds, so the rows read back through ``request_events_all``
equal the ``allocated`` RequestEvent rows the tracker wrote one by one before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.rows import RequestAllocations, epoch_ms

FLUSH_EVERY_S = 5.0
"""Engine seconds an allocation waits at most (while its engine steps) before it is
written: as long as the store gathers rows by default (``--clickhouse-batch-interval``).
With 16-token blocks every decoding request grows a block about every 16 steps, so each
flush writes a row for nearly every running request: at 1 s, 256 running wrote ~256 rows a
second on top of the ~110 of the requests that ended."""


class _Run:
    """One request's allocations since its last row, six ints each in one flat list
    (step, ms after the first, blocks, total blocks, free blocks, tokens): a row's columns
    are its slices, and no tuple is kept per allocation."""

    __slots__ = ("items", "ms0", "ts")

    def __init__(self, ts: float, ms: int) -> None:
        self.ts = ts
        self.ms0 = ms
        self.items: list[int] = []


class Allocations:
    """One engine's open allocation runs, by request ID."""

    def __init__(self, model: str, engine: str, server: str, step_counter: str = "") -> None:
        self.model, self.engine, self.server = model, engine, server
        self.step_counter = step_counter
        """The engine state's step count the rows' steps are of (``EngineState``)."""
        self.runs: dict[str, _Run] = {}
        self.last_flush_ts: float | None = None
        self._ts, self._ms = float("nan"), 0  # the step's time, in store milliseconds...
        self._step, self._free = 0, -1  # ... its number and the pool's free blocks

    def at(self, ts: float, step: int, free: int) -> None:
        """The step whose allocations follow (~16 requests grow in one step at 256
        running: its time is converted once)."""
        if ts != self._ts:
            self._ts, self._ms = ts, epoch_ms(ts)
        self._step, self._free = step, free

    def add(self, rid: str, blocks: int, total: int, tokens: int) -> None:
        """One allocation of ``blocks`` in the step set by ``at``: ``total`` blocks held
        after it, ``tokens`` held."""
        run = self.runs.get(rid)
        if run is None:
            run = self.runs[rid] = _Run(self._ts, self._ms)
        run.items += (self._step, self._ms - run.ms0, blocks, total, self._free, tokens)

    def flush(self, rid: str, emit: Callable[[Any], None]) -> None:
        run = self.runs.pop(rid, None)
        if run is not None:
            emit(self._row(rid, run))

    def flush_due(self, ts: float, emit: Callable[[Any], None]) -> None:
        if self.last_flush_ts is None:
            self.last_flush_ts = ts
        elif ts - self.last_flush_ts >= FLUSH_EVERY_S:
            self.last_flush_ts = ts
            self.flush_all(emit)

    def flush_all(self, emit: Callable[[Any], None]) -> None:
        runs, self.runs = self.runs, {}
        for rid, run in runs.items():
            emit(self._row(rid, run))

    def _row(self, rid: str, run: _Run) -> RequestAllocations:
        items = run.items
        return RequestAllocations(
            ts=run.ts, model=self.model, engine=self.engine, request_id=rid,
            step=items[0::6], offset_ms=items[1::6], blocks=items[2::6],
            total_blocks=items[3::6], free_blocks=items[4::6], tokens=items[5::6],
            server=self.server, step_counter=self.step_counter)
