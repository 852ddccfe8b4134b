"""A bounded on-disk spool of sealed batches, replayed oldest first.

Each batch is one file, written to ``*.tmp``, fsynced and renamed, so a file either holds a
whole batch or does not exist. Its name carries everything needed to replay it after a
restart without opening it: ``<seq>.<table>.<rows>.<created_ms>.<token>.batch``. The spool
is bounded in bytes; when a batch does not fit, ``drop_oldest`` deletes the oldest batches
(never one being sent) and ``drop_newest`` refuses the incoming one; either way every
dropped row is counted by table. One process owns a spool directory (an flock on ``LOCK``).

``combine`` replaces consecutive batches of one table by one batch holding them all, so the
store takes them in one insert: the new batch's file is written and renamed first, and its
token names the sequence numbers it covers (``<hex>-<first>-<last>``), so a crash before the
batches it replaced are deleted leaves them covered: the next start deletes them unread.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Literal

FullPolicy = Literal["drop_oldest", "drop_newest"]
SUFFIX = ".batch"
_COVERS = re.compile(r"[0-9a-f]{32}-([0-9]+)-([0-9]+)")


class SpoolLockedError(RuntimeError):
    """Another process owns this spool directory."""


@dataclass(frozen=True)
class SpooledBatch:
    seq: int
    table: str
    rows: int
    created: float
    """Epoch seconds when the batch's first row was taken (for the oldest-unsent age)."""
    token: str
    """insert_deduplication_token: the same on every attempt, across restarts."""
    size: int

    @property
    def covers(self) -> tuple[int, int] | None:
        """The first and last sequence numbers of the batches this one replaced
        (``Spool.combine``), its table's batches between them included; None for a batch
        as sealed."""
        m = _COVERS.fullmatch(self.token)
        return (int(m[1]), int(m[2])) if m else None

    @property
    def filename(self) -> str:
        return (f"{self.seq:012d}.{self.table}.{self.rows}.{int(self.created * 1000)}."
                f"{self.token}{SUFFIX}")

    @classmethod
    def parse(cls, name: str, size: int) -> SpooledBatch | None:
        parts = name[: -len(SUFFIX)].split(".") if name.endswith(SUFFIX) else []
        if len(parts) != 5 or not (parts[0].isdigit() and parts[2].isdigit()):
            return None
        return cls(int(parts[0]), parts[1], int(parts[2]), int(parts[3]) / 1000, parts[4], size)


class Spool:
    def __init__(self, directory: str, *, max_bytes: int = 256 << 20,
                 policy: FullPolicy = "drop_oldest", fsync: bool = True) -> None:
        if policy not in ("drop_oldest", "drop_newest"):
            raise ValueError(f"spool policy must be drop_oldest or drop_newest, got {policy!r}")
        self.dir = directory
        self.max_bytes = max_bytes
        self.policy = policy
        self.fsync = fsync
        self.dropped: Counter[str] = Counter()
        self.dropped_batches = 0
        self.lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)
        self._lockfile = open(os.path.join(directory, "LOCK"), "a")  # noqa: SIM115
        try:
            fcntl.flock(self._lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lockfile.close()
            raise SpoolLockedError(f"spool {directory} is in use by another process") from None
        self._batches: OrderedDict[int, SpooledBatch] = OrderedDict()
        self._inflight: set[int] = set()
        self._fresh: set[int] = set()
        """Batches this process spooled (``put``) and never handed to the store (``tried``):
        the store cannot hold them, so they may be combined under a new token."""
        self.bytes = 0
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if name.endswith(".tmp"):  # a write cut short: never acknowledged
                os.unlink(path)
            elif (b := SpooledBatch.parse(name, os.path.getsize(path))) is not None:
                self._batches[b.seq] = b
                self.bytes += b.size
        self._next_seq = max(self._batches, default=0) + 1
        for b in list(self._batches.values()):
            if b.covers is not None and b.seq in self._batches:  # a combine cut short
                first, last = b.covers
                for old in [o for o in self._batches.values() if o.table == b.table
                            and first <= o.seq <= last and o.seq != b.seq]:
                    self._forget(old)

    # -- writing (the batching thread) -------------------------------------------------
    def put(self, table: str, rows: int, created: float, token: str,
            payload: bytes | memoryview) -> SpooledBatch | None:
        """Store one batch durably; None when the full policy dropped it."""
        size = len(payload)
        with self.lock:
            if not self._make_room(size):
                self.dropped[table] += rows
                self.dropped_batches += 1
                return None
            batch = SpooledBatch(self._next_seq, table, rows, created, token, size)
            self._next_seq += 1
        self._write(batch, payload)
        with self.lock:
            self._batches[batch.seq] = batch
            self.bytes += size
            self._fresh.add(batch.seq)
        return batch

    def _write(self, batch: SpooledBatch, payload: bytes | memoryview) -> None:
        """``batch``'s file, whole or not at all: written aside, fsynced, renamed."""
        path = os.path.join(self.dir, batch.filename)
        try:
            with open(path + ".tmp", "wb") as f:
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
        except OSError:
            _unlink(path + ".tmp")
            raise
        if self.fsync:
            _fsync_dir(self.dir)

    def _make_room(self, size: int) -> bool:
        if size > self.max_bytes:
            return False
        while self.bytes + size > self.max_bytes:
            if self.policy == "drop_newest":
                return False
            victim = next((b for s, b in self._batches.items() if s not in self._inflight),
                          None)
            if victim is None:
                return False
            self._forget(victim)
            self.dropped[victim.table] += victim.rows
            self.dropped_batches += 1
        return True

    # -- sending (the delivery thread) -------------------------------------------------
    def take(self) -> SpooledBatch | None:
        """The oldest batch, marked in flight (not droppable) until done() or release()."""
        with self.lock:
            b = next(iter(self._batches.values()), None)
            self._inflight = set() if b is None else {b.seq}
            return b

    def is_fresh(self, batch: SpooledBatch) -> bool:
        """Spooled by this process and never handed to the store."""
        return batch.seq in self._fresh

    def tried(self, batch: SpooledBatch) -> None:
        """``batch`` is being handed to the store: it may hold it from now on."""
        with self.lock:
            self._fresh.discard(batch.seq)

    def after(self, head: SpooledBatch) -> list[SpooledBatch]:
        """``head`` (the batch taken) and every batch of its table spooled after it, oldest
        first; all marked in flight until ``done``, ``release`` or ``combine``."""
        with self.lock:
            out = [b for b in self._batches.values()
                   if b.table == head.table and b.seq >= head.seq]
            self._inflight = {b.seq for b in out}
            return out

    def combine(self, parts: list[SpooledBatch], payload: bytes | memoryview) -> SpooledBatch:
        """One batch holding ``payload`` (what ``parts`` hold) in place of ``parts``:
        consecutive fresh batches of one table, oldest first, taken by ``after``. Written
        durably before the parts are deleted; in flight, in the head's place, not fresh."""
        first, last = parts[0], parts[-1]
        with self.lock:
            seq = self._next_seq
            self._next_seq += 1
        batch = SpooledBatch(seq, first.table, sum(p.rows for p in parts), first.created,
                             f"{uuid.uuid4().hex}-{first.seq}-{last.seq}", len(payload))
        self._write(batch, payload)
        with self.lock:
            for p in parts:
                if p.seq in self._batches:
                    self._forget(p)
            self._batches[seq] = batch
            self._batches.move_to_end(seq, last=False)
            self.bytes += batch.size
            self._inflight = {seq}
        return batch

    def read(self, batch: SpooledBatch) -> bytes:
        with open(os.path.join(self.dir, batch.filename), "rb") as f:
            return f.read()

    def done(self, batch: SpooledBatch) -> None:
        """The store acknowledged the batch: forget it."""
        with self.lock:
            self._inflight = set()
            if batch.seq in self._batches:
                self._forget(batch)

    def release(self, batch: SpooledBatch) -> None:
        with self.lock:
            self._inflight = set()

    def _forget(self, batch: SpooledBatch) -> None:
        del self._batches[batch.seq]
        self._fresh.discard(batch.seq)
        self.bytes -= batch.size
        _unlink(os.path.join(self.dir, batch.filename))

    # -- state -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._batches)

    def oldest_created(self) -> float | None:
        with self.lock:
            return min((b.created for b in self._batches.values()), default=None)

    def dropped_rows(self) -> dict[str, int]:
        with self.lock:
            return dict(self.dropped)

    def pending_rows(self) -> Counter[str]:
        with self.lock:
            out: Counter[str] = Counter()
            for b in self._batches.values():
                out[b.table] += b.rows
            return out

    def close(self) -> None:
        """Let the directory go; closing twice (two threads of a closing sink) is harmless."""
        with self.lock:
            if not self._lockfile.closed:
                fcntl.flock(self._lockfile, fcntl.LOCK_UN)
                self._lockfile.close()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
