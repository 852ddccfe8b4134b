"""vLLM's schedule step for step, as the containment tests compare it.

``python -m tests.twin.probe_trail LAYOUT`` prints the trail of a run without the probe
ever imported: the baseline a probed run (faults injected or not) must equal exactly.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvscope.twin import TwinConfig, WorkloadSpec, generate

SPEC = WorkloadSpec(n_requests=40, seed=5)


def need_fails(error: type[Exception]) -> Any:
    """A Recorder class whose storing of the blocks-needed figure raises ``error``: the
    hook's own work fails while it is armed on vLLM's coordinator. (The probe is imported
    here, not above: this module's baseline runs in a process that never imports it.)"""
    from kvscope_probe.recorder import Recorder

    class NeedFails(Recorder):
        @property
        def need(self) -> Any:
            return None

        @need.setter
        def need(self, value: Any) -> None:
            if value is not None:
                raise error("need")

    return NeedFails


def config(layout: str) -> TwinConfig:
    return TwinConfig(num_blocks=96, layout=layout)  # type: ignore[arg-type]


def step_record(out: Any) -> list[Any]:
    """What vLLM decided in one step: scheduled tokens, block tables handed out,
    preemptions and finishes (sorted where vLLM's order is a set's)."""
    c = out.scheduled_cached_reqs
    return [
        sorted(out.num_scheduled_tokens.items()),
        [[r.req_id, [list(g) for g in r.block_ids]] for r in out.scheduled_new_reqs],
        [[rid, None if nb is None else [list(g) for g in nb]]
         for rid, nb in zip(c.req_ids, c.new_block_ids, strict=True)],
        sorted(out.preempted_req_ids),
        sorted(out.finished_req_ids),
    ]


def trail(twin: Any) -> dict[str, Any]:
    """Run SPEC on ``twin``; every step's record plus each request's output tokens."""
    steps: list[Any] = []
    result = twin.run(generate(SPEC), on_step=lambda i, out: steps.append(step_record(out)))
    # The two pool calls no request makes: evicting cached blocks, resetting the cache.
    pool = twin.scheduler.kv_cache_manager.block_pool
    pool.evict_blocks(set(range(0, len(pool.blocks), 2)))
    evicted_free = pool.get_num_free_blocks()
    reset = twin.scheduler.reset_prefix_cache()
    after_reset_free = pool.get_num_free_blocks()
    shutdown = twin.scheduler.shutdown()  # as vLLM's EngineCore.shutdown() ends it
    data = {"steps": steps, "finished": result.finished, "preemptions": result.preemptions,
            "scheduled_tokens": result.scheduled_tokens, "after_evict_free": evicted_free,
            "reset": reset, "after_reset_free": after_reset_free, "shutdown": shutdown}
    return json.loads(json.dumps(data))  # in-process and printed trails compare alike


def main() -> None:
    from kvscope.twin.engine import Twin

    twin = Twin(config(sys.argv[1]), seed=5)
    data = trail(twin)
    assert "kvscope_probe.hooks" not in sys.modules  # the baseline is unprobed
    print(json.dumps(data))


if __name__ == "__main__":
    main()
