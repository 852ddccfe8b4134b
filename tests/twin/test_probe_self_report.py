"""The probe's self-report (Step.probe_ns, kvscope_probe_overhead_seconds_total) counts
the call layers it does not time: each get_new_blocks call and, while armed, the
blocks-needed hook once per scheduled request, at the costs calibrated at attach."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvscope.state.hub import Hub
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin
from kvscope_probe import calibrate, wire
from tests.twin.streaming import stream

pytestmark = pytest.mark.twin

SECOND = 10**9  # an estimated cost no step record's own time comes near


def test_calibrated_costs_are_measured() -> None:
    alloc_ns, need_ns = calibrate.layer_costs()
    assert alloc_ns > 0 and need_ns > 0


@pytest.mark.parametrize("which", ["alloc", "need"])
def test_untimed_layers_are_counted_in_probe_ns(which: str) -> None:
    pt = ProbedTwin(TwinConfig(num_blocks=96), seed=5)
    rec = pt.rec
    rec.alloc_ns, rec.need_ns = (SECOND, 0) if which == "alloc" else (0, SECOND)
    pool = rec.pool
    wrapped = pool.get_new_blocks
    counts = {"allocs": 0}

    def counting(*args: Any, **kwargs: Any) -> Any:
        ret = wrapped(*args, **kwargs)
        counts["allocs"] += bool(ret)
        return ret

    pool.get_new_blocks = counting
    expected: list[int] = []
    armed = [rec.need_armed]

    def on_step(_i: int, out: Any) -> None:
        if which == "alloc":
            expected.append(counts["allocs"])
        else:  # armed through the step that just ran: once per scheduled request
            expected.append(armed[0] * len(out.num_scheduled_tokens))
        counts["allocs"] = 0
        armed[0] = rec.need_armed

    seen: list[int] = []
    pt.hub.listeners.append(lambda kind, _st, s: seen.append(s.probe_ns // SECOND)
                            if kind == "step" else None)
    pt.run(generate(WorkloadSpec(n_requests=40, seed=5)), on_step=on_step)
    assert len(seen) == len(expected) > 0
    # A step carries the probe's time of the step before it (its own record is not done
    # when it is encoded).
    assert seen[0] == 0 and seen[1:] == expected[:-1]
    assert sum(expected) > 0


def _metric(hub: Any, name: str, **labels: str) -> float:
    from kvscope.sidecar.exposition.metrics import KVScopeCollector

    for fam in KVScopeCollector(hub).collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name} {labels} not exposed")


def test_a_frame_reports_the_ring_bytes_still_held_and_their_bound() -> None:
    from kvscope_probe.sender import take_batch

    pt = ProbedTwin(TwinConfig(num_blocks=96), seed=7)
    pt.twin.run(generate(WorkloadSpec(n_requests=60, seed=7)))  # the ring is not drained
    rec = pt.rec
    assert len(rec.ring) > 2 * 128
    while rec.ring:
        frame = take_batch(rec)
        assert frame.ring_bytes == sum(len(data) for _, data in rec.ring)
        assert frame.ring_limit_bytes == rec.ring_bytes
        assert pt.hub.accept(wire.encode(frame))
        assert _metric(pt.hub, "kvscope_probe_ring_bytes") == frame.ring_bytes
    assert _metric(pt.hub, "kvscope_probe_ring_limit_bytes") == rec.ring_bytes == 64 << 20


def test_zmq_io_cpu_counts_the_probes_zmq_threads_and_not_vllms(tmp_path) -> None:
    """libzmq's threads send the probe's frames: their CPU is the probe's cost too. vLLM's
    own ZMQ contexts in the same process have threads of the same names; they must not be
    counted."""
    import time

    import zmq

    from kvscope_probe import iothreads

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
    before = set(os.listdir("/proc/self/task"))  # earlier tests' contexts may linger
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

    # The probe's context is one per process: a sender of an earlier test still ending
    # (connecting, flushing to a sidecar that left) works its I/O thread. Measure once
    # every socket in it has closed, as this test's sender's has.
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
    assert _metric(hub, "kvscope_probe_overhead_seconds_total", thread="zmq_io") == io[-1] / 1e9
