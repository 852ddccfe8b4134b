"""The probe's own ZMQ context, and the CPU time of the threads libzmq runs for it.

libzmq sends from background threads of its own (an I/O thread and a reaper per
context): 1-4 us of CPU per engine step in the twin (benchmarks/README.md, fifth pass),
beside the sender thread's 4-10, work the probe causes in the engine process. vLLM opens
ZMQ contexts of its own in the same process (the engine core's input and output
sockets), whose threads carry the same names, so the probe's context names its threads
with ``THREAD_PREFIX`` ("7135/ZMQbg/IO/0"): only those are counted. Their CPU is read
from each thread's CPU clock (Linux), nanoseconds, about 1 us a read.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

THREAD_PREFIX = 7135
"""libzmq names the context's threads "<prefix>/ZMQbg/...": a number, and short, as a
Linux thread name keeps 15 characters."""

_lock = threading.Lock()
_ctx: Any = None
_ctx_pid = -1


def context() -> Any:
    """The probe's context in this process (a new one after a fork, as pyzmq's
    ``Context.instance()``), its threads named before its first socket starts them."""
    global _ctx, _ctx_pid
    import zmq

    with _lock:
        if _ctx is None or _ctx_pid != os.getpid():
            ctx = zmq.Context(io_threads=1)
            try:
                ctx.set(zmq.THREAD_NAME_PREFIX, THREAD_PREFIX)
            except (AttributeError, zmq.ZMQError):  # a libzmq before 4.3: not named
                pass
            _ctx, _ctx_pid = ctx, os.getpid()
        return _ctx


def close_context(timeout_s: float) -> bool:
    """Terminate this process's probe context (its senders stopped, their sockets closed
    with a linger), waiting at most ``timeout_s``: ``term()`` returns once every frame
    those sockets still queue has gone out or their linger ran out. Without it a process
    that exits loses what libzmq's I/O thread had not yet handed to the kernel: a twin
    that stopped its probe and ended while its sidecar did not read for 0.3 s delivered
    709 of its 1,235 records (tests/twin/test_probe_lifecycle.py). ``term()`` runs on a
    daemon thread, as a socket still open holds it for as long as it stays open: the
    caller never waits past ``timeout_s``. The next ``context()`` makes a new context.
    True when it ended in time."""
    global _ctx
    with _lock:
        ctx, mine = _ctx, _ctx_pid == os.getpid()
        _ctx = None
    if ctx is None or not mine:  # none, or a parent's across a fork: not this one's to end
        return True
    t = threading.Thread(target=_term, args=(ctx,), name="kvscope-probe-term", daemon=True)
    t.start()
    t.join(max(0.0, timeout_s))
    return not t.is_alive()


def _term(ctx: Any) -> None:
    try:
        ctx.term()
    except Exception:  # noqa: BLE001, S110 - a process on its way out: nothing to tell
        pass


def thread_ids() -> list[int]:
    """Native IDs of this process's threads named for the probe's context."""
    mark = f"{THREAD_PREFIX}/"
    found = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(mark):
                    found.append(int(tid))
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return found


def _cpu_clock(tid: int) -> int:
    """Linux's CPU-time clock of one thread of this process (what glibc's
    ``pthread_getcpuclockid`` returns: the thread ID, inverted, shifted, per-thread and
    scheduler-clock bits set)."""
    return (~tid << 3) | 6


class IoCpu:
    """CPU time the probe context's threads have used so far, in ns; 0 where it cannot
    be read (not Linux, threads not named: the wire's "unknown"). Called from one thread
    (the sender's), once its socket exists (the context's threads start with its first
    socket): a first look that finds none gives up, so no later call scans ``/proc``."""

    def __init__(self) -> None:
        self.tids: list[int] | None = None
        self.gone_ns = 0
        """CPU of counted threads that have ended since (a counter never goes back)."""
        self.last: dict[int, int] = {}

    def __call__(self) -> int:
        if self.tids is None:
            self.tids = thread_ids()
        total = 0
        for tid in list(self.tids):
            try:
                ns = time.clock_gettime_ns(_cpu_clock(tid))
            except OSError:  # ended (its context closed): keep what it used
                self.gone_ns += self.last.pop(tid, 0)
                self.tids.remove(tid)
                continue
            self.last[tid] = ns
            total += ns
        return total + self.gone_ns
