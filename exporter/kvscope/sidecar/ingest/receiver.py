"""ZMQ PULL sockets bound where probes connect, and the thread that feeds the Hub.

Two threads: the socket thread only reads messages (and answers CURVE's ZAP requests) into
a queue bounded in bytes; the ingest thread takes them into the Hub and runs its periodic
work. A stalled Hub (a slow scrape holding its lock) therefore never makes ZMQ buffer
without bound: while the queue is full, arriving frames are refused and counted
(``buffer_full``), and the engine's ledger resynchronises at its next keyframe.

tcp endpoints are CURVE servers (``kvscope.sidecar.ingest.auth``); ipc endpoints rely on the
socket file's permissions: 0600, in a directory created 0700.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import zmq

from kvscope.os_thread import name_os_thread
from kvscope.sidecar.ingest.auth import CurveGate
from kvscope.state.hub import Hub
from kvscope_probe.transport import curve_keys, requires_auth

log = logging.getLogger("kvscope.sidecar")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a keyframe of a 1M-block pool fits
DEFAULT_BUFFER_BYTES = 256 * 1024 * 1024
TICK_S = 0.1
BATCH_BYTES = 1 << 20
"""Messages read in one go are handed to the queue once they hold this much."""
TAKE_EVERY_S = 0.5
"""Once the socket thread has read every waiting message it lets the next ones gather in
ZMQ's queue this long, then reads them and hands them to the ingest thread in one go. Work
that follows a rest runs slower than the same work back to back (its caches are cold):
one thread replaying one engine's recorded frames at 256 running took 71-74 us a step back
to back, 134-156 resting 0.1 s before each frame, 92-95 resting 0.25 s before each 3,
81-88 resting 0.5 s before each 6, 82 resting 1 s before each 12 (``benchmarks/
wake_cost.py``); a probe sends a frame every 0.1 s, and with several engines their frames
arrive apart. What the sidecar shows is at most this much later than the probe's frame
(Prometheus scrapes every 15 s or so; the layout is sampled once a second); ZMQ holds at
most this long's messages (``rcvhwm`` bounds their number), the byte-bounded queue the
rest. A probe connecting over tcp waits at most this long for its CURVE authentication
(it waits 1 s for its connection before it drops what it cannot send): each wake-up
answers the ZAP requests waiting, up to 64 (``CurveGate.handle``)."""


def prepare_endpoint(endpoint: str) -> None:
    """Create the directory of an ipc:// endpoint, private to this user; refuse one that
    exists and lets another user replace the socket (``socket_dir_problem``)."""
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        me = os.geteuid()
        for st in (path.parent.lstat(), path.parent.stat()):  # a link, then what it names
            problem = socket_dir_problem(st.st_uid, st.st_mode, me)
            if problem is not None:
                raise ValueError(f"probe endpoint {endpoint}: its directory {path.parent} "
                                 f"cannot hold the socket: {problem}")


def socket_dir_problem(uid: int, mode: int, me: int) -> str | None:
    """Why a directory (or a link to one) of owner ``uid`` and ``mode`` cannot hold the
    probe's socket for user ``me``, or None. Whoever may write in it can replace the socket
    and read what the probe sends: its owner, and those its mode lets write. Trusted: this
    user's own, written by no one else, and root's (``/run``, ``/tmp``, a pod's emptyDir);
    a directory another user made first (``/tmp/kvscope-<uid>`` created by someone else)
    is refused."""
    if uid == 0:
        return None
    if uid != me:
        return f"it belongs to uid {uid}, who could replace the socket"
    if not stat.S_ISLNK(mode) and mode & 0o022:
        return (f"others may write to it (mode {stat.S_IMODE(mode):04o}) and could replace "
                "the socket; make it 0700")
    return None


class FrameQueue:
    """Messages read but not yet ingested; holds at most ``max_bytes`` of them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: deque[tuple[list[bytes], int]] = deque()
        self._cond = threading.Condition()

    def put_all(self, batch: list[list[bytes]]) -> int:
        """Queue each message of ``batch`` in order, waking a waiting reader once; returns
        how many were refused because they did not fit (one larger than the bound still
        passes, alone)."""
        refused = 0
        with self._cond:
            for parts in batch:
                size = sum(len(p) for p in parts)
                if self.bytes + size > self.max_bytes and self._items:
                    refused += 1
                    continue
                self._items.append((parts, size))
                self.bytes += size
            self._cond.notify()
        return refused

    def get(self, timeout_s: float) -> list[bytes] | None:
        with self._cond:
            if not self._items and not self._cond.wait(timeout_s):
                return None
            if not self._items:
                return None
            parts, size = self._items.popleft()
            self.bytes -= size
            return parts

    def __len__(self) -> int:
        return len(self._items)


class Receiver(threading.Thread):
    def __init__(self, hub: Hub, endpoints: list[str], *, secret: bytes | None = None,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, rcvhwm: int = 1000) -> None:
        super().__init__(name="kvscope-receiver", daemon=True)
        self.hub = hub
        self.endpoints = endpoints
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self._reading = threading.Event()
        """Set while the socket thread may still queue frames: the ingest thread stops
        once it is clear and the queue is empty."""
        self._reading.set()
        self.error: BaseException | None = None
        self.queue = FrameQueue(buffer_bytes)
        self.received = 0
        """Messages read from the sockets (queued or refused as buffer_full)."""
        tcp = [ep for ep in endpoints if requires_auth(ep)]
        if tcp and secret is None:
            raise ValueError(f"tcp endpoints {', '.join(tcp)} need the probe secret")
        self._keys = curve_keys(secret) if tcp and secret else None
        self._rcvhwm = rcvhwm
        self._ctx: zmq.Context[Any] | None = None
        """Made with the gate and the sockets by ``bind`` (or ``run``), never here: a
        receiver is in a reference cycle with its ingest thread, and a context dropped
        with its sockets still open waits in its finaliser for them forever, so the first
        cyclic collection after a receiver was built and never started (a sidecar that
        failed to start, a test) hung its process."""
        self.gate: CurveGate | None = None
        self._socks: dict[str, zmq.Socket[Any]] = {}
        self._ingest = threading.Thread(target=self._ingest_loop, name="kvscope-ingest",
                                        daemon=True)

    def _open(self) -> None:
        """The context, the CURVE gate (tcp) and a socket per kind of endpoint; once."""
        if self._ctx is not None:
            return
        self._ctx = ctx = zmq.Context()
        self.gate = CurveGate(ctx, self._keys) if self._keys is not None else None
        for kind in {"tcp" if requires_auth(ep) else "ipc" for ep in self.endpoints}:
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.LINGER, 0)
            if kind == "tcp" and self.gate is not None:
                self.gate.secure(sock)
            self._socks[kind] = sock

    def bind(self) -> None:
        """Bind every endpoint now, so a bad endpoint fails at start, loudly."""
        self._open()
        try:
            for ep in self.endpoints:
                prepare_endpoint(ep)
                self._socks["tcp" if requires_auth(ep) else "ipc"].bind(ep)
                if ep.startswith("ipc://"):
                    os.chmod(ep[len("ipc://"):], 0o600)
        except BaseException:  # never started: nothing else would close them (``_ctx``)
            self._discard()
            raise
        log.info("receiving probe records on %s%s", ", ".join(self.endpoints),
                 " (tcp: CURVE)" if self.gate else "")

    def _close_sockets(self) -> None:
        for s in self._socks.values():
            s.close(0)
        if self.gate:
            self.gate.close()

    def _discard(self) -> None:
        """Close the sockets, the gate and the context of a receiver that will not run."""
        self._close_sockets()
        if self._ctx is not None:
            self._ctx.term()
        self._ctx, self.gate, self._socks = None, None, {}

    def alive(self) -> bool:
        """Both threads run and neither failed (what /healthz reports)."""
        return self.error is None and self.is_alive() and self._ingest.is_alive()

    def refused(self) -> dict[str, int]:
        """Connection attempts refused by CURVE, by reason."""
        return dict(self.gate.refused) if self.gate else {}

    def run(self) -> None:
        name_os_thread()
        self._ingest.start()
        try:  # whatever happens, the ingest thread ends once the queue is drained
            self._open()  # (bound already, unless started without ``bind``)
            poller = zmq.Poller()
            readers = list(self._socks.values())
            for s in readers + (self.gate.sockets() if self.gate else []):
                poller.register(s, zmq.POLLIN)
            self.ready.set()
            while not self.stop_event.is_set():
                read = 0
                for sock, _ in poller.poll(100):
                    if sock in readers:
                        read += self._read(sock)
                    elif self.gate is not None:
                        self.gate.handle(sock)
                if read:  # the next messages gather in ZMQ's queue meanwhile
                    self.stop_event.wait(TAKE_EVERY_S)  # at once when stopping
            for sock in readers:  # what arrived while stopping is ingested too
                self._read(sock)
        except Exception as exc:  # noqa: BLE001 - surfaced through /healthz
            self.error = exc
            log.exception("receiver stopped")
        finally:
            self._reading.clear()
            self._close_sockets()
            self._ingest.join(5.0)
            if self._ctx is not None:
                self._ctx.term()

    def _read(self, sock: zmq.Socket[Any]) -> int:
        """Every message waiting on ``sock`` (at most 1000) into the queue, a batch at a
        time (at most ``BATCH_BYTES`` held outside the bounded queue); how many were
        read."""
        batch: list[list[bytes]] = []
        held = read = 0
        for _ in range(1000):
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            batch.append(parts)
            held += sum(len(p) for p in parts)
            if held >= BATCH_BYTES:
                read += self._queue(batch)
                batch, held = [], 0
        return read + self._queue(batch)

    def _queue(self, batch: list[list[bytes]]) -> int:
        if batch:
            self.received += len(batch)
            for _ in range(self.queue.put_all(batch)):
                self.hub.refuse("buffer_full", f"ingest queue holds {self.queue.bytes} bytes")
        return len(batch)

    def _ingest_loop(self) -> None:
        name_os_thread()
        try:
            next_tick = time.monotonic()
            while self._reading.is_set() or len(self.queue):
                if time.monotonic() >= next_tick:
                    self.hub.tick()
                    next_tick = time.monotonic() + TICK_S
                parts = self.queue.get(TICK_S)  # the socket thread hands frames in batches
                if parts is not None:
                    self.hub.accept(parts)
        except Exception as exc:  # noqa: BLE001 - surfaced through /healthz
            self.error = exc
            log.exception("ingest stopped")

    def stop(self, timeout_s: float = 2.0) -> None:
        self.stop_event.set()
        self.join(timeout_s)
