"""The probe's self-report (Step.probe_ns, kvscope_probe_overhead_seconds_total) counts
the call layers it does not time: each get_new_blocks call and, while armed, the
blocks-needed hook once per scheduled request, at the costs calibrated at attach."""

from __future__ import annotations

from typing import Any

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin
from kvscope_probe import calibrate

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
