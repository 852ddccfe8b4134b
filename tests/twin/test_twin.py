"""The twin drives vLLM's real Scheduler and KVCacheManager; these tests check its runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.twin.config import Policy, TwinConfig
from kvscope.twin.engine import SchedulerOutput, Twin, TwinResult  # imports vLLM, once
from kvscope.twin.scheduler import build_scheduler
from kvscope.twin.workload import TOKEN_ID_MAX, TOKEN_ID_MIN, TwinRequest, WorkloadSpec, generate

pytestmark = pytest.mark.twin

DEFAULT_WORKLOAD = generate(WorkloadSpec())


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the config-only model the twin writes out of the user's cache."""
    path = tmp_path_factory.mktemp("kvscope-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSCOPE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def fcfs_run() -> TwinResult:
    return Twin(TwinConfig()).run(DEFAULT_WORKLOAD)


# --- workload -------------------------------------------------------------------------


def test_workload_is_repeatable_for_a_seed_and_differs_across_seeds() -> None:
    assert generate(WorkloadSpec(seed=0)) == DEFAULT_WORKLOAD
    other = generate(WorkloadSpec(seed=1))
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in DEFAULT_WORKLOAD]


def within_binomial(k: int, n: int, p: float) -> bool:
    """``k`` successes of ``n`` draws with chance ``p`` lie within four standard deviations
    of ``n * p`` (a seeded draw outside that is a generator bug, not bad luck)."""
    return abs(k - n * p) <= 4 * (n * p * (1 - p)) ** 0.5


@pytest.mark.parametrize("spec", [
    WorkloadSpec(),
    WorkloadSpec(n_requests=250, short_fraction=0.2, shared_prefix_fraction=0.8, waves=3,
                 wave_interval_steps=7, seed=5),
    WorkloadSpec(n_requests=37, short_fraction=0.5, waves=5, priorities=(1, 2), seed=2),
], ids=["default", "mostly-long", "uneven-waves"])
def test_workload_follows_its_spec(spec: WorkloadSpec) -> None:
    reqs = generate(spec)
    n = spec.n_requests
    assert len(reqs) == n
    assert len({r.request_id for r in reqs}) == n
    tokens = {t for r in reqs for t in r.prompt_token_ids}
    assert min(tokens) >= TOKEN_ID_MIN and max(tokens) < TOKEN_ID_MAX
    assert all(spec.max_tokens[0] <= r.max_tokens <= spec.max_tokens[1] for r in reqs)
    assert {r.priority for r in reqs} == set(range(spec.priorities[0], spec.priorities[1] + 1))
    # spec.waves groups of equal size (within one), wave_interval_steps apart
    arrivals = [r.arrival_step for r in reqs]
    steps = [w * spec.wave_interval_steps for w in range(spec.waves)]
    assert sorted(set(arrivals)) == steps
    assert all(n // spec.waves <= arrivals.count(s) <= -(-n // spec.waves) for s in steps)
    # prompt lengths: short, long, or long after the shared prefix
    short = [r for r in reqs if len(r.prompt_token_ids) <= spec.short_prompt[1]]
    assert all(spec.short_prompt[0] <= len(r.prompt_token_ids) for r in short)
    assert within_binomial(len(short), n, spec.short_fraction), len(short)
    long_prompts = [r.prompt_token_ids for r in reqs if r not in short]
    prefix, n_sharing = Counter(p[: spec.shared_prefix_len] for p in long_prompts).most_common(1)[0]
    sharing = [p for p in long_prompts if p[: spec.shared_prefix_len] == prefix]
    assert len(sharing) == n_sharing and 1 < n_sharing < len(long_prompts)
    assert within_binomial(n_sharing, len(long_prompts), spec.shared_prefix_fraction)
    lo, hi = spec.long_prompt
    assert all(lo + spec.shared_prefix_len <= len(p) <= hi + spec.shared_prefix_len
               for p in sharing)
    assert all(lo <= len(p) <= hi for p in long_prompts if p not in sharing)


def test_workload_validate_reports_every_error() -> None:
    bad = WorkloadSpec(short_fraction=1.5, long_prompt=(700, 300), waves=0)
    assert len(bad.validate()) == 3
    with pytest.raises(ValueError, match="short_fraction"):
        generate(bad)


# --- config ---------------------------------------------------------------------------


def test_default_config_is_valid() -> None:
    assert TwinConfig().validate() == []
    assert TwinConfig(policy="priority", num_blocks=4096).validate() == []


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"block_size": 24}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 16}, "max_num_batched_tokens"),
        ({"max_model_len": 8192, "num_blocks": 4096}, "max_model_len"),
        ({"num_blocks": 20}, "fewer than max_model_len"),
        ({"policy": "lifo"}, "policy"),
    ],
)
def test_validate_rejects_bad_configs(changes: dict[str, object], fragment: str) -> None:
    errors = replace(TwinConfig(), **changes).validate()
    assert len(errors) == 1 and fragment in errors[0]


def test_validate_reports_all_errors_at_once_and_build_refuses() -> None:
    bad = TwinConfig(block_size=24, num_blocks=1, policy="lifo")  # type: ignore[arg-type]
    assert len(bad.validate()) == 3
    with pytest.raises(ValueError, match="num_blocks"):
        build_scheduler(bad)


# --- runs -----------------------------------------------------------------------------


def test_build_scheduler_mirrors_the_config() -> None:
    sched = build_scheduler(TwinConfig(num_blocks=64, policy="priority"))
    assert sched.kv_cache_manager.block_pool.num_gpu_blocks == 64
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63  # minus the null block
    assert sched.policy.value == "priority"
    assert sched.max_num_running_reqs == 32


def test_default_run_finishes_every_request(fcfs_run: TwinResult) -> None:
    assert fcfs_run.finished == len(DEFAULT_WORKLOAD)
    assert fcfs_run.steps > max(r.arrival_step for r in DEFAULT_WORKLOAD)  # last wave served
    prompt_tokens = sum(len(r.prompt_token_ids) for r in DEFAULT_WORKLOAD)
    assert fcfs_run.scheduled_tokens > prompt_tokens


def test_default_mix_preempts_and_repeats_exactly(fcfs_run: TwinResult) -> None:
    assert fcfs_run.preemptions > 0
    again = Twin(TwinConfig()).run(DEFAULT_WORKLOAD)
    assert (again.preemptions, again.steps, again.scheduled_tokens) == (
        fcfs_run.preemptions,
        fcfs_run.steps,
        fcfs_run.scheduled_tokens,
    )


def test_a_large_pool_never_preempts() -> None:
    result = Twin(TwinConfig(num_blocks=4096)).run(DEFAULT_WORKLOAD)
    assert result.finished == len(DEFAULT_WORKLOAD)
    assert result.preemptions == 0


def _priority_inversions(policy: Policy) -> tuple[int, int]:
    """Run the default mix; count preemptions, and steps where a preempted request
    outranked (lower priority value, or earlier arrival) one left running."""
    twin = Twin(TwinConfig(policy=policy))
    inversions = 0

    def check(_: int, out: SchedulerOutput) -> None:
        nonlocal inversions
        preempted = [twin.scheduler.requests[rid] for rid in out.preempted_req_ids]
        running = twin.scheduler.running
        if preempted and running:
            least = min((r.priority, r.arrival_time) for r in preempted)
            inversions += least < max((r.priority, r.arrival_time) for r in running)

    result = twin.run(DEFAULT_WORKLOAD, on_step=check)
    assert result.finished == len(DEFAULT_WORKLOAD)
    return result.preemptions, inversions


def test_priority_policy_preempts_the_lowest_priority_first() -> None:
    preemptions, inversions = _priority_inversions("priority")
    assert preemptions > 0 and inversions == 0
    # The check can fail: FCFS preempts the newest request whatever its priority.
    fcfs_preemptions, fcfs_inversions = _priority_inversions("fcfs")
    assert fcfs_preemptions > 0 and fcfs_inversions > 0


def test_sampled_tokens_are_in_range_and_prompts_too_long_are_refused() -> None:
    twin = Twin(TwinConfig(), seed=3)
    seen: list[int] = []

    def collect(_: int, out: SchedulerOutput) -> None:
        for rid in out.num_scheduled_tokens:
            req = twin.scheduler.requests.get(rid)
            if req is not None:
                seen.extend(req.output_token_ids)

    result = twin.run(DEFAULT_WORKLOAD[:10], on_step=collect)
    assert result.finished == 10 and seen
    assert all(TOKEN_ID_MIN <= t < TOKEN_ID_MAX for t in seen)
    with pytest.raises(ValueError, match="no room"):
        twin.add(TwinRequest("huge", tuple([5] * 1024), 8, 0, 0))


def test_max_steps_stops_early_and_the_run_can_be_resumed() -> None:
    twin = Twin(TwinConfig())
    first = twin.run(DEFAULT_WORKLOAD[:30], max_steps=10)
    assert first.steps == 10 and twin.has_work()
    rest = twin.run([])
    assert first.finished + rest.finished == 30 and not twin.has_work()


def test_idle_gaps_are_skipped_and_pacing_slows_steps() -> None:
    """A request arriving long after the last one finished starts at once: the run is
    exactly the two runs alone, back to back, with no idle steps between."""
    early, late = DEFAULT_WORKLOAD[0], replace(DEFAULT_WORKLOAD[1], arrival_step=5000)
    alone = [Twin(TwinConfig()).run([r]).steps for r in (early, late)]
    assert alone[0] < late.arrival_step  # the premise: the early one is done long before
    result = Twin(TwinConfig()).run([late, early])
    assert result.finished == 2 and result.steps == sum(alone)
    interval = 0.02
    paced = Twin(TwinConfig()).run([early], max_steps=5, step_interval_s=interval)
    # each step waits for its slot and sleep never returns early; 1 ms for clock rounding
    assert paced.steps == 5 and paced.wall_seconds >= paced.steps * interval - 1e-3
