"""Queueing, batching, write-ahead spooling and retries for a sink; knows no store.

Rows flow: ``take()`` (the receiver thread; never blocks, never raises) appends to a
bounded deque per table -> the batching thread seals a table's batch when it holds
``batch_rows`` rows or its first row is ``batch_interval_s`` old, encodes it and writes it
to the spool (write-ahead: from then on the rows survive a crash) -> the sending thread
sends spooled batches oldest first, each with its own dedup token, and deletes a batch only
after the store acknowledged it. A crash, even ``kill -9``, between the store's answer and
the delete leaves the batch spooled: it is sent again at the next start with the same
token, and the store discards the repeat. Rows still in memory (at most one batch interval
plus a tick) are not acknowledged: ``flush()`` returns once they are spooled and, within its
timeout, delivered.

With ``insert_interval_s`` and a ``combine``, a table's spooled batches wait until the
oldest one's first row is that old, then go to the store as one batch (``Spool.combine``,
written durably before the batches it replaces are deleted): an insert costs the embedded
store the same whatever its rows, and rows still become durable every ``batch_interval_s``.
Only batches this process spooled and never tried to send are combined, so a batch the store
may already hold keeps its token; a ``flush()`` sends what waits at once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvscope.os_thread import name_os_thread
from kvscope.sinks.base import BatchRejected, SinkStats, StoreUnavailable
from kvscope.sinks.options import Backoff, DeliveryOptions
from kvscope.sinks.spool import Spool, SpooledBatch
from kvscope.throttle import worth_logging

log = logging.getLogger("kvscope.sinks")

Encode = Callable[[str, list[Any]], bytes]
"""Turns one table's rows into the bytes that are spooled and sent."""
Send = Callable[[SpooledBatch, bytes, int], None]
"""Delivers one batch (its spooled bytes, the attempt number from 0); raises on failure."""
Check = Callable[[], None]
"""Reaches the store without sending rows (connect, a trivial query); raises on failure."""
Combine = Callable[[list[bytes]], bytes | memoryview]
"""One payload holding the rows of several payloads of one table, in order; raises when
they cannot be one (different columns)."""
MAX_COMBINED_BYTES = 32 << 20
"""Batches are combined up to this many bytes (one insert's payload, held in memory)."""


@dataclass
class _Buffer:
    rows: list[Any] = field(default_factory=list)
    since: float = 0.0


class Delivery:
    """The queue -> spool -> store pipeline of one sink, on two daemon threads."""

    def __init__(self, name: str, tables: list[str], encode: Encode, send: Send, spool: Spool,
                 options: DeliveryOptions, *,
                 describe: Callable[[BaseException], str] = repr,
                 check: Check | None = None, combine: Combine | None = None) -> None:
        self.name, self.encode, self.send, self.spool, self.opt = name, encode, send, spool, options
        self.describe, self.check = describe, check
        self.combine = combine if options.insert_interval_s > 0 else None
        self._flushing = 0
        self.queues: dict[str, deque[Any]] = {t: deque() for t in tables}
        self.buffers: dict[str, _Buffer] = {t: _Buffer() for t in tables}
        # Each counter has one writing thread, and every table's key exists from the start,
        # so stats() can copy them from another thread.
        self.written: Counter[str] = Counter(dict.fromkeys(tables, 0))
        self.queue_dropped: Counter[str] = Counter(dict.fromkeys(tables, 0))
        self.batch_dropped: Counter[str] = Counter(dict.fromkeys(tables, 0))  # batching thread
        self.rejected: Counter[str] = Counter(dict.fromkeys(tables, 0))  # sending thread
        self.spool_errors = 0
        self.send_errors = 0
        self.connected = False  # nothing seen of the store yet
        self.last_error = ""
        self._wake = threading.Event()
        self._spooled = threading.Event()
        self._stop = threading.Event()
        self._cv = threading.Condition()
        self._asked = self._sealed = 0
        self._left = False  # the last forced seal left rows in memory (the spool refused)
        self._running = 2
        self._threads = [threading.Thread(target=self._leaving, args=(self._batch_loop,),
                                          name=f"{name}-batch", daemon=True),
                         threading.Thread(target=self._leaving, args=(self._send_loop,),
                                          name=f"{name}-send", daemon=True)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _leaving(self, loop: Callable[[], None]) -> None:
        """Run ``loop``; the last thread out of a closing pipeline lets its spool go, so
        a close that could not wait out a hanging insert frees the spool once it ends."""
        try:
            loop()
        finally:
            with self._cv:
                self._running -= 1
                last = self._running == 0
            if last and self._stop.is_set():
                self.spool.close()

    # -- the receiver thread -----------------------------------------------------------
    def take(self, table: str, row: Any) -> None:
        q = self.queues[table]
        n = len(q)
        if n >= self.opt.max_queue_rows:
            self.queue_dropped[table] += 1
            return
        q.append(row)
        if n + 1 == self.opt.batch_rows:
            self._wake.set()

    # -- the batching thread -----------------------------------------------------------
    def _batch_loop(self) -> None:
        name_os_thread()
        tick = min(0.25, self.opt.batch_interval_s / 4)
        while not self._stop.is_set():
            self._wake.wait(tick)
            self._wake.clear()
            asked = self._asked
            try:
                self._seal_due(force=asked > self._sealed)
            except Exception:  # noqa: BLE001 - this thread must outlive any bug
                self.spool_errors += 1
                log.exception("%s: batching failed; retrying next tick", self.name)
                continue
            if asked > self._sealed:
                with self._cv:
                    self._sealed = asked
                    self._left = any(b.rows for b in self.buffers.values())
                    self._cv.notify_all()

    def _seal_due(self, force: bool) -> None:
        now = time.time()
        for table, q in self.queues.items():
            buf = self.buffers[table]
            n = len(q)
            if n:
                if not buf.rows:
                    buf.since = now
                pop = q.popleft
                buf.rows.extend([pop() for _ in range(n)])
            while len(buf.rows) >= self.opt.batch_rows:
                chunk = buf.rows[: self.opt.batch_rows]
                if not self._seal(table, chunk, buf.since):
                    break
                del buf.rows[: self.opt.batch_rows]
            if buf.rows and (force or now - buf.since >= self.opt.batch_interval_s):
                if self._seal(table, buf.rows, buf.since):
                    buf.rows = []
            if len(buf.rows) > self.opt.max_queue_rows:  # the spool keeps failing
                self.batch_dropped[table] += len(buf.rows)
                buf.rows = []

    def _seal(self, table: str, rows: list[Any], since: float) -> bool:
        try:
            payload = self.encode(table, rows)
        except Exception:  # noqa: BLE001 - a row that cannot be encoded never will be
            log.exception("%s: dropping %d %s rows that cannot be encoded", self.name,
                          len(rows), table)
            self.spool_errors += 1
            self.batch_dropped[table] += len(rows)
            return True
        try:
            self.spool.put(table, len(rows), since, uuid.uuid4().hex, payload)
        except OSError as exc:
            self.spool_errors += 1
            self.last_error = f"spool: {exc}"
            log.error("%s: cannot spool %d %s rows (%s); will retry", self.name, len(rows),
                      table, exc)
            return False
        self._spooled.set()
        return True

    # -- the sending thread ------------------------------------------------------------
    def _send_loop(self) -> None:
        name_os_thread()
        backoff = Backoff(self.opt.backoff_initial_s, self.opt.backoff_max_s)
        attempts: tuple[int, int] = (0, 0)  # (seq, failed attempts) of the head batch
        look_at = time.monotonic() if self.check else float("inf")  # the next idle look
        while not self._stop.is_set():
            batch = self.spool.take()
            if batch is None:
                if time.monotonic() >= look_at:
                    look_at = time.monotonic() + self._look(backoff)
                self._spooled.wait(min(0.5, max(0.0, look_at - time.monotonic())))
                self._spooled.clear()
                continue
            if self.check:
                look_at = time.monotonic() + self.opt.check_interval_s
            wait = self._wait_s(batch)
            if wait > 0:  # a flush() or a newly spooled batch looks again sooner
                self.spool.release(batch)
                self._spooled.wait(wait)
                self._spooled.clear()
                continue
            batch = self._combined(batch)
            self.spool.tried(batch)  # the store may hold it from now on: never combined
            tries = attempts[1] if attempts[0] == batch.seq else 0
            try:
                payload = self.spool.read(batch)
            except OSError as exc:  # gone or unreadable: no retry will read it
                self._reject(batch, f"cannot read {batch.filename}: {self.describe(exc)}")
                continue
            try:
                self.send(batch, payload, tries)
            except BatchRejected as exc:
                self._reject(batch, self.describe(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - any failure is retried with backoff
                self.spool.release(batch)
                if self._stop.is_set():
                    break  # closing: the batch stays spooled for the next start
                self._failed(exc, len(self.spool))
                if not isinstance(exc, StoreUnavailable):  # the store's fault, not the batch's
                    attempts = (batch.seq, tries + 1)
                self._stop.wait(backoff.next())
                continue
            self.spool.done(batch)
            self.written[batch.table] += batch.rows
            self._reached(backoff)

    def _reject(self, batch: SpooledBatch, why: str) -> None:
        """Give ``batch`` up for good: deleted, its rows counted dropped, logged once."""
        self.spool.done(batch)
        self.rejected[batch.table] += batch.rows
        self.send_errors += 1
        self.last_error = why
        log.error("%s: dropped a batch of %d %s rows: %s", self.name, batch.rows, batch.table,
                  why)

    def _wait_s(self, head: SpooledBatch) -> float:
        """Seconds the oldest batch waits for more of its table to join it (none if the
        clock went back past its first row)."""
        if (self.combine is None or not self.spool.is_fresh(head) or self._flushing
                or self._stop.is_set()):
            return 0.0
        left = head.created + self.opt.insert_interval_s - time.time()
        return left if 0 < left <= self.opt.insert_interval_s else 0.0

    def _combined(self, head: SpooledBatch) -> SpooledBatch:
        """``head`` with the batches of its table spooled after it and never sent, as one
        (up to ``MAX_COMBINED_BYTES``); ``head`` alone when there is nothing to join or
        they cannot be joined."""
        if self.combine is None or not self.spool.is_fresh(head):
            return head
        parts: list[SpooledBatch] = []
        size = 0
        for b in self.spool.after(head):
            if not self.spool.is_fresh(b) or (parts and size + b.size > MAX_COMBINED_BYTES):
                break
            parts.append(b)
            size += b.size
        if len(parts) < 2:
            return head
        try:
            batch = self.spool.combine(parts, self.combine([self.spool.read(b) for b in parts]))
        except Exception as exc:  # noqa: BLE001 - sent one by one, as sealed
            self.spool_errors += 1
            log.error("%s: cannot combine %d %s batches (%s); sending them one by one",
                      self.name, len(parts), head.table, self.describe(exc))
            return head
        return batch

    def _look(self, backoff: Backoff) -> float:
        """Reach the store with no batch to send (at start, on an idle night, and while it
        is away at the backoff's pace); returns the seconds until the next look."""
        try:
            self.check()  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - a failed look is a failed attempt
            self._failed(exc, len(self.spool))
            return backoff.next()
        self._reached(backoff)
        return self.opt.check_interval_s

    def _reached(self, backoff: Backoff) -> None:
        if not self.connected and (self.send_errors or len(self.spool)):
            log.warning("%s: store reachable again; %d batches left to replay", self.name,
                        len(self.spool))
        self.connected = True
        backoff.reset()

    def _failed(self, exc: BaseException, spooled: int) -> None:
        self.send_errors += 1
        self.last_error = self.describe(exc)
        if self.connected or worth_logging(self.send_errors):
            log.warning("%s: delivery failed (%s); %d batches spooled, retrying with "
                        "backoff", self.name, self.last_error, spooled)
        self.connected = False

    # -- control -----------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Spool every row taken so far, then wait for delivery; True when all delivered
        (False while rows the spool refused wait in memory)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._asked += 1
            self._flushing += 1  # nothing waits to be combined meanwhile
            asked = self._asked
        try:
            self._wake.set()
            self._spooled.set()
            with self._cv:
                while self._sealed < asked and self._threads[0].is_alive():
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._cv.wait(left):
                        return False
                if self._left:  # rows only in memory: not delivered, not even durable
                    return False
            while (len(self.spool) and time.monotonic() < deadline
                   and self._threads[1].is_alive()):
                time.sleep(0.005)
            return not len(self.spool)
        finally:
            with self._cv:
                self._flushing -= 1

    def close(self, timeout_s: float) -> bool:
        """Flush within the timeout and stop; what is undelivered stays spooled, and rows
        that never reached the spool are counted dropped."""
        start = time.monotonic()
        delivered = self.flush(timeout_s)
        self._stop.set()
        self._wake.set()
        self._spooled.set()
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.1, timeout_s - (time.monotonic() - start)))
        if not self._threads[0].is_alive():
            self._drop_unspooled()
        if not any(t.is_alive() for t in self._threads):
            self.spool.close()  # else an insert still runs: the last thread out closes it
        return delivered

    def _drop_unspooled(self) -> None:
        """At close, rows still in memory (the spool refused them) go with the process:
        counted dropped, and said."""
        for table, q in self.queues.items():
            buf = self.buffers[table]
            n = len(buf.rows) + len(q)
            if n:
                self.batch_dropped[table] += n
                buf.rows = []
                q.clear()
                log.error("%s: closing with %d %s rows never spooled; counted dropped",
                          self.name, n, table)

    def stats(self) -> SinkStats:
        dropped = dict(self.queue_dropped)
        for counter in (self.batch_dropped, self.rejected, self.spool.dropped_rows()):
            for table, n in dict(counter).items():
                dropped[table] = dropped.get(table, 0) + n
        oldest = [b.since for b in self.buffers.values() if b.rows]
        spooled = self.spool.oldest_created()
        if spooled is not None:
            oldest.append(spooled)
        queued = sum(len(q) for q in self.queues.values())
        queued += sum(len(b.rows) for b in self.buffers.values())
        return SinkStats(
            rows_written=dict(self.written), rows_dropped=dropped,
            errors=self.spool_errors + self.send_errors,
            spool_bytes=self.spool.bytes, spool_batches=len(self.spool),
            oldest_unsent_age_seconds=max(0.0, time.time() - min(oldest)) if oldest else 0.0,
            queued_rows=queued, connected=self.connected, last_error=self.last_error)
