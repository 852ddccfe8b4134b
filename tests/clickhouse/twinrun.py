"""A twin run with the probe and the RequestTracker, as tests/twin/test_requests.py does it,
handing every row to one callable (a SinkManager.emit, a list's append, or both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.sidecar.hub import Hub
from kvscope.sidecar.requests import RequestTracker
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.engine import Twin
from kvscope_probe import plugin, wire
from kvscope_probe.recorder import Recorder
from kvscope_probe.sender import take_batch

BLOCK_SIZE = TwinConfig().block_size


def run_twin(emit: Callable[[Any], None], n_requests: int = 80, seed: int = 5,
             on_step: Callable[[int], None] | None = None) -> tuple[Hub, Any]:
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=48), seed=seed)
    rec = Recorder(twin.scheduler, ring_size=1 << 20, keyframe_interval_s=3600)
    plugin.bind(twin.scheduler, rec)
    rec.push(rec.hello)
    hub = Hub()
    tracker = RequestTracker(emit)
    hub.listeners.append(tracker.on_event)

    def step(i: int, _out: object) -> None:
        while rec.ring:
            assert hub.accept(wire.encode(take_batch(rec)))
        if on_step is not None:
            on_step(i)

    result = twin.run(generate(WorkloadSpec(n_requests=n_requests, seed=seed)), on_step=step)
    tracker.flush(hub.engines)
    return hub, result
