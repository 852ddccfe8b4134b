"""One sink interface and a manager that fans rows out to every sink.

``write`` is called on the receiver thread and must never block: a sink queues or
spools, and does its I/O on its own thread. Every sink counts what it wrote and lost.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from kvscope.rows import table_of
from kvscope.throttle import worth_logging

log = logging.getLogger("kvscope.sinks")


class Sink(Protocol):
    name: str

    def accepts(self, table: str) -> bool:
        """Whether rows of this table are for this sink (asked once per table: the answer
        must not change)."""

    def write(self, table: str, row: Any) -> None:
        """Take one row; never blocks, never raises."""

    def flush(self, timeout_s: float) -> None:
        """Deliver or spool everything taken so far, within the timeout."""

    def close(self, timeout_s: float) -> None: ...


class SinkManager:
    """Routes each row to the sinks that accept its table."""

    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])
        self.errors = 0
        self._routes: dict[str, tuple[Sink, ...]] = {}
        """The sinks of each table, asked once (rows come ~3 a step per engine, and the
        tracker asks ``wants`` for three tables every step)."""

    def add(self, sink: Sink) -> None:
        self.sinks.append(sink)
        self._routes = {}

    def _sinks_of(self, table: str) -> tuple[Sink, ...]:
        sinks = self._routes.get(table)
        if sinks is None:
            sinks = self._routes[table] = tuple(s for s in self.sinks if s.accepts(table))
        return sinks

    def wants(self, table: str) -> bool:
        """Whether any sink takes rows of ``table``: rows nobody takes are not built."""
        return bool(self._sinks_of(table))

    def emit(self, row: Any) -> None:
        table = table_of(row)
        for sink in self._sinks_of(table):
            try:
                sink.write(table, row)
            except Exception:  # noqa: BLE001 - a sink bug must not stop ingestion
                self.errors += 1
                if worth_logging(self.errors):
                    log.exception("sink %s failed to take a row", sink.name)

    def flush(self, timeout_s: float = 5.0) -> None:
        for sink in self.sinks:
            sink.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        for sink in self.sinks:
            try:
                sink.close(timeout_s)
            except Exception:  # noqa: BLE001
                log.exception("closing sink %s failed", sink.name)


class BatchRejected(Exception):
    """The store refused this batch for good (its data, not the store's state): the batch is
    dropped and its rows counted, so one bad batch cannot block the ones behind it."""


class StoreUnavailable(Exception):
    """The store cannot be reached or prepared (connect, schema): not the batch's fault, so
    the failure never counts toward rejecting the batch; it is retried with backoff."""


@dataclass(frozen=True)
class SinkStats:
    """A sink's own health, read by kvscope.sinks.metrics.SinkCollector."""

    rows_written: dict[str, int]
    """Rows the store acknowledged, by table."""
    rows_dropped: dict[str, int]
    """Rows given up (queue overflow, full spool, rejected batch, never spooled by close),
    by table."""
    errors: int
    """Failed attempts to deliver or spool a batch."""
    spool_bytes: int
    spool_batches: int
    oldest_unsent_age_seconds: float
    """Age of the oldest row taken but not yet acknowledged by the store (0: none)."""
    queued_rows: int
    """Rows in memory, not yet spooled."""
    connected: bool
    """The sink's last attempt to reach its store (a batch, or an idle check) succeeded;
    False before the first."""
    last_error: str = ""
