"""The probe's background thread: ring records -> frames -> ZMQ PUSH.

Runs off vLLM's engine thread. Sends never block: with a full high-water mark or no
connected sidecar the batch is dropped and counted; the first send that goes through
after drops asks for a keyframe, so the sidecar can resynchronise (while it is away no
send goes through, and no keyframe is forced).

The thread wakes once per flush interval (``KVSCOPE_PROBE_FLUSH_S``, 0.1 s) and sends
what the ring holds. Its cost is per wakeup, not per record: each wakeup takes the GIL
from the engine thread and gives it back several times (the socket calls release it).
Measured on the twin at 187 requests a step (benchmarks/README.md, fourth pass): 20-25 us
of sender CPU a step with a 20 ms interval, 6-8 us with 0.1 s, 2.5 us with 1 s. The
sidecar sees records at most one interval late, far below any scrape interval. Sending
from the engine thread instead was measured too, and cost the engine thread what it saved
here.

Bounded in bytes: a frame holds at most MAX_BATCH records and MAX_FRAME_BYTES, and the
socket queues at most ``hwm`` frames, so a sidecar that stops reading holds at most
``hwm`` x MAX_FRAME_BYTES in this process (128 MiB by default) before frames are
dropped and counted.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import msgspec

from kvscope_probe import transport, wire
from kvscope_probe.iothreads import IoCpu
from kvscope_probe.recorder import Recorder

log = logging.getLogger("kvscope_probe")

MAX_BATCH = 128
MAX_FRAME_BYTES = 1 << 20
"""A frame stops growing at this many bytes of records (one record always goes)."""
DEFAULT_HWM = 128
"""Frames the socket queues for a sidecar that does not read: at most 128 MiB, and at the
default interval about 13 s of records (frames below MAX_BATCH carry one interval)."""
SEND_WAIT_MS = 200
FLUSH_INTERVAL_S = 0.1
"""The pause between wakeups, busy or idle: a frame carries the records of one interval."""
HEARTBEAT_S = 2.0
"""A heartbeat goes out when no record was sent for this long (wire.Heartbeat)."""


def pop_run(rec: Recorder, limit: int = MAX_BATCH) -> tuple[int, list[bytes]]:
    """Pop up to ``limit`` ring entries (MAX_FRAME_BYTES of them, at least one) with
    consecutive sequence numbers."""
    ring = rec.ring
    first, data = ring.popleft()
    items = [data]
    size = len(data)
    expect = first + 1
    while (ring and len(items) < limit and ring[0][0] == expect
           and size + len(ring[0][1]) <= MAX_FRAME_BYTES):
        data = ring.popleft()[1]
        items.append(data)
        size += len(data)
        expect += 1
    rec.popped_bytes += size
    return first, items


def take_batch(rec: Recorder) -> wire.Frame:
    """Pop up to MAX_BATCH ring entries with consecutive sequence numbers as one frame."""
    return make_frame(rec, *pop_run(rec))


def make_frame(rec: Recorder, first: int, items: list[bytes], cpu_ns: int = 0,
               io_ns: int = 0) -> wire.Frame:
    """The ring's records are encoded already: a frame is a list around them, its
    records msgspec.Raw (encoding the frame copies their bytes). ``cpu_ns``: the sender
    thread's CPU time so far, ``io_ns`` libzmq's threads' (``iothreads.IoCpu``)."""
    return _frame(rec, first, list(map(msgspec.Raw, items)), cpu_ns, io_ns)


def unfinished(sched: Any) -> int:
    """vLLM's own count of unfinished requests, read on this (the sender's) thread: its
    method reads queue lengths and the pause state, nothing it changes; -1 when it fails."""
    try:
        return int(sched.get_num_unfinished_requests())
    except Exception:  # noqa: BLE001 - a vLLM without it, or a read mid-change
        return -1


def _frame(rec: Recorder, first: int, records: list[Any], cpu_ns: int,
           io_ns: int) -> wire.Frame:
    return wire.Frame(
        engine=rec.hello.engine,
        session=rec.hello.session,
        first_seq=first,
        dropped=rec.ring_dropped + rec.send_dropped,
        faults=rec.faults,
        records=records,
        sender_cpu_ns=cpu_ns,
        io_cpu_ns=io_ns,
        ring_bytes=rec.pushed_bytes - rec.popped_bytes,
        ring_limit_bytes=rec.ring_bytes,
    )


class Sender(threading.Thread):
    """Drains one Recorder's ring to a ZMQ PUSH socket connected to the sidecar."""

    def __init__(self, rec: Recorder, endpoint: str, *, hwm: int = DEFAULT_HWM,
                 flush_s: float = FLUSH_INTERVAL_S) -> None:
        super().__init__(name="kvscope-probe-sender", daemon=True)
        # Weak: the Recorder holds vLLM's scheduler and pool, and a thread is a root the
        # collector never frees. When vLLM drops its scheduler, the thread ends.
        self._rec = weakref.ref(rec)
        self.endpoint = endpoint
        self.hwm = hwm
        self.flush_s = flush_s
        self.wakeups = 0
        self.sent = 0
        self.heartbeats = 0
        self.stop_event = threading.Event()
        self._sock: Any = None
        self._last_send = time.monotonic()
        self._seen_seq = -1
        self._seen_at: float | None = None
        self.io_cpu = IoCpu()

    @property
    def rec(self) -> Recorder:
        """The Recorder; ReferenceError once vLLM's scheduler (and so it) is gone."""
        rec = self._rec()
        if rec is None:
            raise ReferenceError("the scheduler this sender recorded is gone")
        return rec

    @property
    def orphaned(self) -> bool:
        return self._rec() is None

    def _socket(self) -> Any:
        return transport.push_socket(self.endpoint, hwm=self.hwm)

    def heartbeat(self, now: float) -> None:
        """While no record went out for HEARTBEAT_S, tell the sidecar this probe lives.

        Costs the engine thread nothing: the time of the last step is when this thread
        last saw the recorder's sequence number move (within one flush interval)."""
        rec = self.rec
        seq = rec.seq
        if seq != self._seen_seq:
            self._seen_seq, self._seen_at = seq, now
        if now - self._last_send < HEARTBEAT_S:
            return
        self._last_send = now
        since = -1.0 if self._seen_at is None else now - self._seen_at
        frame = _frame(rec, seq, [wire.Heartbeat(ts=time.time(), since_step_s=since,
                                                 unfinished=unfinished(rec.sched))],
                       time.thread_time_ns(), self.io_cpu())
        if transport.send(self._sock, wire.encode(frame), 0):
            self.heartbeats += 1

    def run(self) -> None:

        try:
            self._sock = self._socket()
        except Exception as exc:  # noqa: BLE001
            log.warning("kvscope probe: cannot open %s (%r); recording off", self.endpoint, exc)
            rec = self._rec()
            if rec is not None:
                rec.enabled = False
            del rec
            return
        try:
            transport.await_connection(self._sock)
        except Exception as exc:  # noqa: BLE001
            self._fault(exc)
        while not self.stop_event.is_set() and not self.orphaned:
            self.wakeups += 1
            try:
                n = self.drain_once()
                now = time.monotonic()
                if n:
                    self._last_send = now
                self.heartbeat(now)
            except ReferenceError:
                break
            except Exception as exc:  # noqa: BLE001
                self._fault(exc)
                n = 0
            # a backlog (drain_once stops at 4 x MAX_BATCH): keep draining
            self.stop_event.wait(0.001 if n >= 4 * MAX_BATCH else self.flush_s)
        deadline = time.monotonic() + 2.0  # flush what is left, boundedly
        try:
            self._flush_left(deadline)
        except ReferenceError:
            pass  # the scheduler went first: nothing left to flush
        # frames queued in the socket go out while the process lives, and as it ends
        # while plugin.stop_all ends the probe's context (iothreads.close_context)
        self._sock.close(linger=int(max(0.1, deadline - time.monotonic()) * 1000))

    def _fault(self, exc: Exception) -> None:
        rec = self._rec()
        if rec is not None:
            rec.fault("sender", exc, rescan=False)

    def _flush_left(self, deadline: float) -> None:
        rec = self.rec
        while rec.ring and time.monotonic() < deadline:
            self.drain_once(deadline)
        left = len(rec.ring)  # what could not be sent in time is dropped, and counted
        rec.ring.clear()
        rec.send_dropped += left
        del rec

    def drain_once(self, deadline: float | None = None) -> int:
        """Send what the ring holds now (up to 4 x MAX_BATCH entries); return how many
        entries were handled.

        Every frame may wait SEND_WAIT_MS for a sidecar that does not read, and a ring
        with gaps (a full ring drops records) splits into a frame per run: one call could
        wait minutes. So it stops once vLLM has stopped the sender (the last flush takes
        over), and no wait runs past ``deadline`` (the last flush's): a sender ends at
        most one wait after its stop plus the flush's bound.

        Only what was there when it started: each send releases the GIL, the engine
        thread pushes a record or two meanwhile, and chasing them sent a frame of a few
        records per hand-off (14 a frame, 60 frames a wakeup in tests/twin/
        test_sender_pace.py) where a wakeup needs one frame per MAX_BATCH records."""
        import zmq

        handled = 0
        rec = self.rec
        todo = min(len(rec.ring), 4 * MAX_BATCH)
        while rec.ring and handled < todo:
            if deadline is None:
                if self.stop_event.is_set():
                    break
                wait_ms = SEND_WAIT_MS
            else:
                wait_ms = min(SEND_WAIT_MS, int((deadline - time.monotonic()) * 1000))
                if wait_ms <= 0:
                    break
            first, items = pop_run(rec, min(MAX_BATCH, todo - handled))
            n = len(items)
            handled += n
            try:
                frame = make_frame(rec, first, items, time.thread_time_ns(), self.io_cpu())
                # A busy sidecar (or its starved I/O thread) fills the pipe for moments:
                # wait a little on this thread rather than drop. The engine thread never
                # waits; if this wait lasts, the ring fills and drops are counted there.
                if not transport.send(self._sock, wire.encode(frame), wait_ms):
                    raise zmq.Again()
                self.sent += n
                if rec.resync_pending:  # the sidecar reads again: resynchronise it
                    rec.resync_pending = False
                    rec.want_keyframe = True
            except Exception as exc:  # noqa: BLE001
                # The batch is gone whatever failed (building, encoding or sending it):
                # count it, so dropped + received always equals what the probe recorded.
                rec.send_dropped += n
                rec.resync_pending = True
                if not isinstance(exc, zmq.Again):
                    rec.fault("sender", exc, rescan=False)
        return handled
