"""The twin builds each KV layout and scheduler the way vLLM's engine would.

Groups come from vLLM's own planner over the layout's layer specs; async scheduling is
vLLM's ``AsyncScheduler`` with two batches in flight; a draft-model speculator reserves
its lookahead slots; a pool vLLM would refuse to start with is refused.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvscope.twin.config import TwinConfig
from kvscope.twin.engine import Twin
from kvscope.twin.scheduler import build_scheduler
from kvscope.twin.workload import WorkloadSpec, generate

pytestmark = pytest.mark.twin

GROUPS = {
    "full": [("FullAttentionSpec", 2)],
    "full+sliding": [("SlidingWindowSpec", 1), ("SlidingWindowSpec", 1),
                     ("FullAttentionSpec", 1)],
    "sliding": [("SlidingWindowSpec", 2)],
    "mamba-hybrid": [("MambaSpec", 2), ("FullAttentionSpec", 2)],
}


@pytest.mark.parametrize("layout", list(GROUPS))
def test_each_layout_gets_vllms_groups_over_one_pool(layout: str) -> None:
    sched = build_scheduler(TwinConfig(num_blocks=128, layout=layout))  # type: ignore[arg-type]
    groups = sched.kv_cache_config.kv_cache_groups
    assert [(type(g.kv_cache_spec).__name__, len(g.layer_names)) for g in groups] \
        == GROUPS[layout]
    assert sched.kv_cache_manager.block_pool.num_gpu_blocks == 128
    windows = {g.kv_cache_spec.sliding_window for g in groups
               if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec"}
    assert windows <= {TwinConfig.sliding_window}


def test_mamba_follows_vllms_cache_mode_for_prefix_caching() -> None:
    on = build_scheduler(TwinConfig(num_blocks=64, layout="mamba-hybrid"))
    off = build_scheduler(TwinConfig(num_blocks=64, layout="mamba-hybrid",
                                     enable_prefix_caching=False))
    mamba_on, mamba_off = (s.kv_cache_config.kv_cache_groups[0].kv_cache_spec for s in (on, off))
    assert (mamba_on.mamba_cache_mode, mamba_on.block_size) == ("align", 32)
    assert (mamba_off.mamba_cache_mode, mamba_off.block_size) == ("none", 1024)


def outputs_after_steps(cfg: TwinConfig, steps: int) -> int:
    """Output tokens vLLM has recorded after ``steps`` engine steps of a short mix."""
    twin = Twin(cfg)
    for r in generate(WorkloadSpec(n_requests=8, seed=3, short_fraction=1.0)):
        twin.add(r)
    for _ in range(steps):
        twin.step()
    return sum(r.num_output_tokens for r in twin.scheduler.requests.values())


def test_async_scheduling_keeps_one_step_in_flight() -> None:
    cfg = TwinConfig(num_blocks=64, async_scheduling=True)
    twin = Twin(cfg)
    assert type(twin.scheduler).__name__ == "AsyncScheduler"
    assert twin.scheduler.vllm_config.max_concurrent_batches == 2
    sync = replace(cfg, async_scheduling=False)
    # Step 1 prefills every short prompt: the synchronous engine feeds its sampled tokens
    # back at once, the async one only once step 2 has been scheduled.
    assert outputs_after_steps(sync, 1) == 8
    assert outputs_after_steps(cfg, 1) == 0
    assert outputs_after_steps(cfg, 2) == 8
    reqs = generate(WorkloadSpec(n_requests=20, seed=3))
    result = twin.run(reqs)
    assert result.finished == 20 and not twin.has_work()


def test_a_draft_model_speculator_reserves_lookahead_and_shortens_the_run() -> None:
    reqs = generate(WorkloadSpec(n_requests=40, seed=1))
    plain = Twin(TwinConfig(num_blocks=256)).run(reqs)
    spec_twin = Twin(TwinConfig(num_blocks=256, num_speculative_tokens=2))
    assert spec_twin.scheduler.num_lookahead_tokens == 2
    spec = spec_twin.run(reqs)
    assert spec.finished == plain.finished == 40
    assert spec.steps < plain.steps  # accepted drafts: more than one token a step


def test_a_pool_too_small_for_the_layout_is_refused_with_vllms_reason() -> None:
    with pytest.raises(ValueError, match="invalid TwinConfig: To serve at least one request"):
        build_scheduler(TwinConfig(num_blocks=48, layout="full+sliding"))


def test_validate_names_bad_layout_fields() -> None:
    bad = TwinConfig(layout="linear", sliding_window=0,  # type: ignore[arg-type]
                     num_speculative_tokens=-1)
    errors = bad.validate()
    assert len(errors) == 3
    assert any("layout" in e for e in errors) and any("sliding_window" in e for e in errors)
    assert TwinConfig(layout="sliding", num_blocks=20).validate() == []  # no full group
