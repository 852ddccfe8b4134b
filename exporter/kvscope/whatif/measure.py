"""One ``kvscope whatif`` setting measured the way kvscope measures a live engine.

The twin (vLLM's real scheduler, no model) runs with the probe bound in-process; after
every step the probe's ring is drained into wire frames, encoded, decoded and fed to a
sidecar ``Hub`` with a ``RequestTracker`` listening, exactly as ``kvscope serve`` would
receive them. Every figure below is read from that Hub (its counters, extremes and
ledger) or from the tracker's per-request traces, so it is what kvscope would report
for a real server running the same settings and workload.

Importing this module is light; ``measure`` imports vLLM (about 13 s the first time).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvscope.twin.config import TwinConfig
from kvscope.twin.workload import TwinRequest

StepProgress = Callable[[int, int], None]
"""Called after every step with (steps so far, preemptions so far)."""


@dataclass(frozen=True)
class Measurement:
    """What kvscope reported for one setting; all but ``wall_seconds`` repeat exactly."""

    requests: int
    """Requests in the workload."""
    finished: int
    """Requests that ended (their end reached the sidecar)."""
    steps: int
    """Scheduler steps until the workload drained (or ``max_steps``)."""
    drained: bool
    """False when the run stopped at ``max_steps`` with work left."""
    preemptions: dict[str, int] = field(default_factory=dict)
    """Preemptions by reason (``kv_full``, ``priority``, ``unknown``)."""
    preempted_tokens: int = 0
    """Computed tokens discarded by preemptions."""
    recomputed_tokens: int = 0
    """Of those, tokens computed again when the victims resumed."""
    tail_waste_mean: float = 0.0
    """Mean over steps of reserved but unfilled token slots in running requests' blocks."""
    tail_waste_peak: int = 0
    tail_waste_ratio: float = 0.0
    """Sum of tail waste over steps / sum of allocated slots (used blocks x block size)."""
    peak_used_blocks: int = 0
    usable_blocks: int = 0
    """Blocks that can hold KV (the pool minus the null block)."""
    mean_budget_utilization: float = 0.0
    """Mean over steps of scheduled tokens / token budget."""
    mean_blocks_per_request: float = 0.0
    """Mean over finished requests of the most blocks each held at once."""
    records: list[dict[str, Any]] = field(default_factory=list, repr=False, compare=False)
    """Per-request outcome records of the run (``kvscope.whatif.recorded``), arrival order."""
    faults: int = 0
    """Ledger gaps and mismatches, audit mismatches with vLLM's pool, probe faults,
    steps the sidecar missed: must be 0."""
    wall_seconds: float = 0.0
    """Building the scheduler and running the workload; varies run to run."""

    @property
    def preemptions_total(self) -> int:
        return sum(self.preemptions.values())

    @property
    def preemption_rate(self) -> float:
        """Preemptions per request."""
        return self.preemptions_total / self.requests if self.requests else 0.0


@dataclass
class _TailWaste:
    """Tail waste sampled from the sidecar's ledger after every step."""

    steps: int = 0
    total: int = 0
    peak: int = 0
    slots: int = 0

    def sample(self, waste: int, allocated_slots: int) -> None:
        self.steps += 1
        self.total += waste
        self.peak = max(self.peak, waste)
        self.slots += allocated_slots


def measure(
    cfg: TwinConfig,
    requests: Sequence[TwinRequest],
    *,
    seed: int = 0,
    max_steps: int | None = None,
    on_step: StepProgress | None = None,
) -> Measurement:
    """Run ``requests`` through a fresh twin configured by ``cfg`` and read kvscope's view.

    Installs the probe's hooks in this process (``plugin.enable(None)``: schedulers are
    recorded only when bound by hand, as here), like the twin tests do.
    """
    from kvscope.rows import RequestTrace
    from kvscope.state.hub import Hub
    from kvscope.state.requests import RequestTracker
    from kvscope.twin.probed import ProbedTwin
    from kvscope.whatif.recorded import outcome_records

    started = time.perf_counter()
    rows: list[object] = []
    hub = Hub()
    hub.listeners.append(RequestTracker(rows.append).on_event)
    # A ring that never fills and one keyframe: every later step is exact op replay.
    probed = ProbedTwin(cfg, seed=seed, keyframe_interval_s=1e9, hub=hub)
    waste = _TailWaste()
    seen = {"preemptions": 0}

    def after_step(index: int, out: object) -> None:
        led = probed.state.ledger
        if led.synced:
            waste.sample(led.tail_waste_tokens(), led.used * cfg.block_size)
        seen["preemptions"] += len(out.preempted_req_ids)  # type: ignore[attr-defined]
        if on_step is not None:
            on_step(index + 1, seen["preemptions"])

    result = probed.run(requests, on_step=after_step, max_steps=max_steps)
    st = hub.engines.get(probed.engine)
    if st is None:
        raise RuntimeError("the twin took no step: the workload is empty")
    twin, rec = probed.twin, probed.rec
    c, ex = st.counters, st.extremes
    blocks_held = [r.allocated_blocks for r in rows if isinstance(r, RequestTrace)]
    return Measurement(
        requests=len(requests),
        finished=sum(c.ends.values()),
        steps=c.steps,
        drained=not twin.has_work(),
        preemptions=dict(c.preemptions),
        preempted_tokens=c.preempted_tokens,
        recomputed_tokens=c.recomputed_tokens,
        tail_waste_mean=waste.total / waste.steps if waste.steps else 0.0,
        tail_waste_peak=waste.peak,
        tail_waste_ratio=waste.total / waste.slots if waste.slots else 0.0,
        peak_used_blocks=ex.peak_used,
        usable_blocks=st.ledger.usable_blocks,
        mean_budget_utilization=ex.util_sum / ex.util_steps if ex.util_steps else 0.0,
        mean_blocks_per_request=sum(blocks_held) / len(blocks_held) if blocks_held else 0.0,
        records=outcome_records(rows),
        faults=(c.gaps + c.ledger_mismatches + rec.faults + (result.steps != c.steps)
                + sum(st.audit.mismatches.values())),
        wall_seconds=time.perf_counter() - started,
    )
