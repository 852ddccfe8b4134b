"""vLLM's real scheduler (the twin) stepping as fast as it can while a real ``Sender``
streams the probe's records to a PULL socket: the probe's sending path end to end, with
no sidecar in between."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin, sender, wire
from kvscope_probe.recorder import Recorder


@dataclass
class Streamed:
    rec: Recorder
    snd: sender.Sender
    frames: list[wire.Frame]
    """Every frame the socket received, in order."""
    steps: int
    """Records made while the twin ran (``rec.seq`` when it stopped)."""
    busy_s: float


def stream(tmp_path: Path, *, n_requests: int = 400, seed: int = 3, flush_s: float,
           keyframe_interval_s: float = 3600) -> Streamed:
    """Run a seeded workload on a 256-block twin with the probe bound by hand, its sender
    started, then stop the sender (it flushes) and collect what arrived."""
    from kvscope.twin.engine import Twin

    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=256), seed=seed)
    rec = Recorder(twin.scheduler, ring_size=1 << 20, keyframe_interval_s=keyframe_interval_s)
    plugin.bind(twin.scheduler, rec)
    rec.push(rec.hello)
    endpoint = f"ipc://{tmp_path}/probe.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(endpoint)
    snd = sender.Sender(rec, endpoint, flush_s=flush_s)
    snd.start()
    try:
        started = time.monotonic()
        twin.run(generate(WorkloadSpec(n_requests=n_requests, seed=seed)), max_steps=100_000)
        steps = rec.seq
        busy_s = time.monotonic() - started
    finally:
        snd.stop_event.set()
        snd.join(10)
    frames = []
    while pull.poll(500):
        frames.append(wire.decode(pull.recv_multipart()))
    pull.close(0)
    return Streamed(rec, snd, frames, steps, busy_s)
