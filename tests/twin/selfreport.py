"""Run in a fresh interpreter by ``tests/twin/test_probe_self_report.py``: the probe's ZMQ
I/O CPU counts the probe context's threads only, not those of another context of the same
process (vLLM's own), measured with this process's probe context holding nothing but the
test's sender.

    python -m tests.twin.selfreport TMP_DIR

Prints ``ZMQ IO OK`` when every check held (a failed one raises, exit status 1)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from kvscope.state.hub import Hub
from kvscope_probe import iothreads, wire
from tests.twin.streaming import stream


def metric(hub: Any, name: str, **labels: str) -> float:
    """One sample of the sidecar's own collector for ``hub``."""
    from kvscope.sidecar.exposition.metrics import KVScopeCollector

    for fam in KVScopeCollector(hub).collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name} {labels} not exposed")


def check_zmq_io(tmp_path: Path) -> None:
    run = stream(tmp_path, flush_s=0.02, keyframe_interval_s=0.05)
    snd, frames = run.snd, run.frames
    io = [f.io_cpu_ns for f in frames]
    assert len(frames) > 10 and io == sorted(io) and io[-1] > 0

    def comm(tid: int | str) -> str:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                return f.read().strip()
        except FileNotFoundError:  # a thread that ended since the listing
            return ""

    names = {tid: comm(tid) for tid in iothreads.thread_ids()}
    assert sorted(names.values()) == ["7135/ZMQbg/IO/0", "7135/ZMQbg/Reap"]
    assert set(snd.io_cpu.tids) == set(names)

    # A context of vLLM's kind, busy: its I/O thread works, the probe's count stays put.
    before = set(os.listdir("/proc/self/task"))  # the threads before that context
    other = zmq.Context()
    a, b = other.socket(zmq.PUSH), other.socket(zmq.PULL)
    port = b.bind_to_random_port("tcp://127.0.0.1")
    a.connect(f"tcp://127.0.0.1:{port}")
    # libzmq names its I/O thread from inside that thread once it runs: until then its
    # name is the process's, so wait for the name rather than read it once.
    deadline = time.monotonic() + 10
    theirs: list[int] = []
    while not theirs and time.monotonic() < deadline:
        theirs = [int(t) for t in set(os.listdir("/proc/self/task")) - before
                  if comm(t) == "ZMQbg/IO/0"]
        time.sleep(0.01)
    assert len(theirs) == 1 and not set(theirs) & set(names)

    def their_cpu() -> int:
        return sum(time.clock_gettime_ns(iothreads._cpu_clock(t)) for t in theirs)

    # This interpreter's probe context holds this sender's socket only, closed by now
    # (stop, then join: waited for, as a join under load can outlast its timeout).
    def open_sockets() -> int:
        return sum(not s.closed for s in list(iothreads.context()._sockets))

    deadline = time.monotonic() + 60
    while open_sockets() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_sockets() == 0
    probe0, theirs0 = snd.io_cpu(), their_cpu()
    for _ in range(200):
        a.send(b"x" * (1 << 20))
        b.recv()
    probe1, theirs1 = snd.io_cpu(), their_cpu()
    a.close(0)
    b.close(0)
    other.term()
    assert theirs1 - theirs0 > 10_000_000  # 200 MiB through their I/O thread
    assert probe1 - probe0 < (theirs1 - theirs0) / 100, \
        (probe1 - probe0, theirs1 - theirs0, open_sockets())

    hub = Hub()
    for f in frames:
        assert hub.accept(wire.encode(f))
    assert metric(hub, "kvscope_probe_overhead_seconds_total", thread="zmq_io") == io[-1] / 1e9


if __name__ == "__main__":
    check_zmq_io(Path(sys.argv[1]))
    print("ZMQ IO OK", flush=True)
