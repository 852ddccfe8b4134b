"""The probe's self-report (Step.probe_ns, kvscope_probe_overhead_seconds_total) counts
the call layers it does not time: each get_new_blocks call and, while armed, the
blocks-needed hook once per scheduled request, at the costs calibrated at attach."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin
from kvscope_probe import calibrate, wire
from tests.twin.selfreport import metric

pytestmark = pytest.mark.twin
ROOT = Path(__file__).resolve().parents[2]

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
        assert metric(pt.hub, "kvscope_probe_ring_bytes") == frame.ring_bytes
    assert metric(pt.hub, "kvscope_probe_ring_limit_bytes") == rec.ring_bytes == 64 << 20


def test_zmq_io_cpu_counts_the_probes_zmq_threads_and_not_vllms(tmp_path) -> None:
    """libzmq's threads send the probe's frames: their CPU is the probe's cost too. vLLM's
    own ZMQ contexts in the same process have threads of the same names; they must not be
    counted. In a fresh interpreter (``tests/twin/selfreport.py``): the probe's context is
    one per process, and sockets other tests left in it (a middleware emitter reconnecting
    to a sidecar that stopped: CI on 1d21888, still open 60 s on) work its I/O thread."""
    done = subprocess.run([sys.executable, "-m", "tests.twin.selfreport", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ZMQ IO OK" in done.stdout, done.stderr[-6000:]
