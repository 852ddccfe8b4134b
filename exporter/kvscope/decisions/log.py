"""Layer 4: one JSON line per scheduler decision, for Alloy / promtail to ship to Loki.

Lines go to stdout or to a size-rotated file. Each line carries a stable ``msg`` (so a
LogQL line filter like ``|= "Preempting request"`` keeps working) and the facts as fields.
No prompt or completion text ever reaches this log: rows carry IDs, counts and reasons.

Off the hot path: ``write`` (the ingest thread, under the hub lock) only appends the row to
a bounded queue; a writer thread formats and writes lines, a batch at most every
``LINGER_S`` (``flush`` hurries it). A slow stdout pipe or disk therefore never stalls
ingestion or ``/metrics``: the queue fills, and rows that find it full are dropped and
counted; a failed write is counted as an error and its lines as
dropped. Both appear in ``kvscope_sink_*{sink="decision_log"}``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import deque
from datetime import datetime, timezone
from typing import IO, Any

import msgspec

from kvscope.os_thread import name_os_thread
from kvscope.rows import SchedulerDecision
from kvscope.sinks.base import SinkStats
from kvscope.throttle import worth_logging

log = logging.getLogger("kvscope.sinks")

TABLE = "scheduler_decisions"
MAX_BATCH = 1000
LINGER_S = 0.25
"""How long the writer gathers lines after the first of a batch: one wakeup and one
write a quarter second, not one per decision (a busy engine makes ~100 a second, and each
wakeup takes the GIL from the ingest thread)."""


def decision_line(d: SchedulerDecision) -> str:
    """The JSON line for one decision (keys stable; documented in the README). Characters
    past printable ASCII (DEL included) are written as UTF-8, not escaped."""
    return _encode({
        "ts": iso_ms(d.ts),
        "level": "info",
        "logger": "kvscope.decisions",
        "server": d.server,
        "engine": d.engine,
        "model": d.model,
        "event": d.decision,
        "request_id": d.request_id,
        "reason": d.reason or None,
        "blocks_needed": None if d.blocks_needed < 0 else d.blocks_needed,
        "free_blocks": None if d.free_blocks < 0 else d.free_blocks,
        "max_contiguous": None if d.max_contiguous_free < 0 else d.max_contiguous_free,
        "tokens": None if d.tokens < 0 else d.tokens,
        "policy": d.policy,
        "msg": d.msg,
    }).decode()


_encode = msgspec.json.Encoder().encode
"""~0.4 µs a line where ``json.dumps`` took ~4 (the writer thread formats ~100 lines a
second per busy engine)."""
_second: tuple[int, str] = (0, datetime.fromtimestamp(0, tz=timezone.utc).isoformat()[:-6])
"""The last second formatted: (whole seconds, its date and time of day)."""


def iso_ms(ts: float) -> str:
    """``datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds")``,
    with the date and time of day formatted once a second: the same rounding (``ts`` to
    the microsecond, half to even, as CPython's ``fromtimestamp``; then the milliseconds
    truncated, as ``isoformat``), a third of the cost."""
    global _second
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    sec = int(whole)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    elif us < 0:
        sec, us = sec - 1, us + 1_000_000
    cached = _second
    if cached[0] != sec:
        cached = _second = (sec, datetime.fromtimestamp(sec, tz=timezone.utc)
                            .isoformat()[:-6])
    return f"{cached[1]}.{us // 1000:03d}+00:00"


class DecisionLog:
    """Writes decision lines to a stream or a file rotated at ``max_bytes``, on its own
    thread, from a queue of at most ``max_queue`` rows."""

    name = "decision_log"

    def __init__(self, path: str | None = None, *, max_bytes: int = 50 << 20,
                 backups: int = 5, stream: IO[str] | None = None,
                 max_queue: int = 50_000) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.max_queue = max_queue
        self.lines = 0
        self.dropped = 0
        self.errors = 0
        self.last_error = ""
        self._stream = stream
        self._file: IO[str] | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - held open
        self._queue: deque[tuple[float, SchedulerDecision]] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._hurry = 0  # flush() calls waiting: no lingering meanwhile
        self._thread = threading.Thread(target=self._run, name="kvscope-decision-log",
                                        daemon=True)
        self._thread.start()

    def accepts(self, table: str) -> bool:
        return table == TABLE

    def write(self, table: str, row: Any) -> None:
        with self._cond:
            if len(self._queue) >= self.max_queue or self._closing:
                self.dropped += 1
                return
            self._queue.append((time.time(), row))
            n = len(self._queue)
            if n == 1 or n == MAX_BATCH:  # the writer waits for a first row, or lingers
                self._cond.notify()

    # -- the writer thread ----------------------------------------------------------
    def _run(self) -> None:
        name_os_thread()
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                until = time.monotonic() + LINGER_S
                while (len(self._queue) < MAX_BATCH and not self._closing
                       and not self._hurry):
                    left = until - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = [self._queue.popleft()
                         for _ in range(min(MAX_BATCH, len(self._queue)))]
                self._busy = True
            try:
                self._write_lines("".join(decision_line(r) + "\n" for _, r in batch))
                self.lines += len(batch)
                self.last_error = ""
            except Exception as exc:  # noqa: BLE001 - a full disk or closed pipe: count it
                self.errors += 1
                self.dropped += len(batch)
                self.last_error = type(exc).__name__
                if worth_logging(self.errors):
                    log.warning("decision log write failed (%d so far): %r", self.errors, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write_lines(self, text: str) -> None:
        if self._file is not None:
            self._file.write(text)
            self._file.flush()
            if self._file.tell() >= self.max_bytes:
                self._rotate()
        else:
            out = self._stream or sys.stdout
            out.write(text)
            out.flush()

    def _rotate(self) -> None:
        assert self._file is not None and self.path
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    # -- sink interface ---------------------------------------------------------------
    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s``) until every queued line is written."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                while (self._queue or self._busy) and self._thread.is_alive():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._cond.wait(left)
            finally:
                self._hurry -= 1

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._closing = True
            self.dropped += len(self._queue)  # what the timeout left unwritten
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._file is not None and not self._thread.is_alive():
            self._file.close()
            self._file = None

    def stats(self) -> SinkStats:
        with self._cond:
            queued = len(self._queue)
            oldest = self._queue[0][0] if self._queue else None
        return SinkStats(
            rows_written={TABLE: self.lines}, rows_dropped={TABLE: self.dropped},
            errors=self.errors, spool_bytes=0, spool_batches=0,
            oldest_unsent_age_seconds=max(0.0, time.time() - oldest) if oldest else 0.0,
            queued_rows=queued, connected=not self.last_error, last_error=self.last_error)
