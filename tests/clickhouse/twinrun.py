"""A twin run with the probe and the RequestTracker, as tests/twin/test_requests.py does it,
handing every row to one callable (a SinkManager.emit, a list's append, or both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.state.hub import Hub
from kvscope.state.requests import RequestTracker
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin

BLOCK_SIZE = TwinConfig().block_size


def run_twin(emit: Callable[[Any], None], n_requests: int = 80, seed: int = 5,
             on_step: Callable[[int], None] | None = None) -> tuple[Hub, Any]:
    pt = ProbedTwin(TwinConfig(num_blocks=48), seed=seed)
    tracker = RequestTracker(emit)
    pt.hub.listeners.append(tracker.on_event)

    def step(i: int, _out: object) -> None:
        if on_step is not None:
            on_step(i)

    result = pt.run(generate(WorkloadSpec(n_requests=n_requests, seed=seed)), on_step=step)
    tracker.flush(pt.hub.engines)
    return pt.hub, result
