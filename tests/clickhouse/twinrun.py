"""A twin run with the probe and the RequestTracker, as tests/twin/test_requests.py does it,
handing every row to one callable (a SinkManager.emit, a list's append, or both)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.state.hub import Hub
from kvscope.state.requests import RequestTracker
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin
from kvscope_probe import wire
from kvscope_probe.sender import take_batch

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


def run_twin_restarting_sidecar(emit_before: Callable[[Any], None],
                                emit_after: Callable[[Any], None], *, restart_step: int,
                                outage_steps: int, spec: WorkloadSpec) -> None:
    """A twin run whose sidecar restarts while the engine runs on: after ``restart_step``
    steps the sidecar (a Hub and its RequestTracker, writing to ``emit_before``) flushes
    and goes; what the probe sends in the next ``outage_steps`` steps is lost; then a new
    one (writing to ``emit_after``) takes up the same probe session from the next keyframe
    the probe sends, as one started by hand or by Kubernetes does."""
    pt = ProbedTwin(TwinConfig(num_blocks=48), seed=spec.seed)
    tracker = RequestTracker(emit_before)
    pt.hub.listeners.append(tracker.on_event)
    state = {"listening": True}

    def step(i: int, _out: object) -> None:
        nonlocal tracker
        if i == restart_step:
            tracker.flush(pt.hub.engines)
            state["listening"] = False
        elif i == restart_step + outage_steps:
            pt.hub = Hub()
            tracker = RequestTracker(emit_after)
            pt.hub.listeners.append(tracker.on_event)
            pt.rec.next_keyframe_ns = 0  # the probe's next periodic keyframe is due
            state["listening"] = True

    def drain() -> None:
        while pt.rec.ring:
            frame = take_batch(pt.rec)
            if state["listening"]:  # frames of a session it has no hello of are refused
                pt.hub.accept(wire.encode(frame))

    pt.drain = drain  # type: ignore[method-assign]
    pt.run(generate(spec), on_step=step)
    tracker.flush(pt.hub.engines)
