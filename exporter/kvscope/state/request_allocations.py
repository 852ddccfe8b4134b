"""Requests' block allocations, collected per request and written as arrays.

One ``Allocations`` per engine; ``add`` appends one allocation to its request's open run,
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
    __slots__ = ("blocks", "free", "ms0", "offsets", "steps", "tokens", "totals", "ts")

    def __init__(self, ts: float) -> None:
        self.ts = ts
        self.ms0 = epoch_ms(ts)
        self.steps: list[int] = []
        self.offsets: list[int] = []
        self.blocks: list[int] = []
        self.totals: list[int] = []
        self.free: list[int] = []
        self.tokens: list[int] = []


class Allocations:
    """One engine's open allocation runs, by request ID."""

    def __init__(self, model: str, engine: str, server: str) -> None:
        self.model, self.engine, self.server = model, engine, server
        self.runs: dict[str, _Run] = {}
        self.last_flush_ts: float | None = None

    def add(self, rid: str, ts: float, step: int, blocks: int, total: int, free: int,
            tokens: int) -> None:
        run = self.runs.get(rid)
        if run is None:
            run = self.runs[rid] = _Run(ts)
        run.steps.append(step)
        run.offsets.append(epoch_ms(ts) - run.ms0)
        run.blocks.append(blocks)
        run.totals.append(total)
        run.free.append(free)
        run.tokens.append(tokens)

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
        return RequestAllocations(
            ts=run.ts, model=self.model, engine=self.engine, request_id=rid, step=run.steps,
            offset_ms=run.offsets, blocks=run.blocks, total_blocks=run.totals,
            free_blocks=run.free, tokens=run.tokens, server=self.server)
