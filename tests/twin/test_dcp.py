"""Decode context parallelism: vLLM's managers allocate blocks of the spec's block size
times the ranks a sharded spec is spread over (``SingleTypeKVCacheManager.__init__``).

The twin builds vLLM's real scheduler with ``--decode-context-parallel-size 2`` (no model
runs, so the tensor-parallel size it implies only passes vLLM's config check): 32-token
specs, 64-token blocks. The probe must size groups, waste and the waiting head's bound as
vLLM allocates, not as the spec reads.
"""

from __future__ import annotations

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin
from kvscope.twin.workload import TwinRequest
from tests.twin.exactness import PoolCheck, head_needs

pytestmark = pytest.mark.twin


def test_blocks_are_sized_as_vllm_allocates_them_under_dcp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pt, heads, after = head_needs(monkeypatch, lambda: ProbedTwin(
        TwinConfig(num_blocks=24, decode_context_parallel_size=2), seed=3))
    (manager,) = pt.scheduler.kv_cache_manager.coordinator.single_type_managers
    assert (manager.kv_cache_spec.block_size, manager.block_size) == (32, 64)
    assert [g.block_size for g in pt.rec.hello.kv_groups] == [64]
    check = PoolCheck(pt)  # the ledger, free runs and group figures against vLLM's, each step
    long = [TwinRequest(f"long{i}", (i + 1,) * 600, 40, 0, 0) for i in range(3)]
    mixed = generate(WorkloadSpec(n_requests=40, seed=3))
    result = pt.run(long + mixed, on_step=after)
    assert result.finished == len(long) + len(mixed)
    assert check.steps == result.steps and check.preemptions > 0
    assert heads and all(bound >= need for bound, need in heads), heads
    assert (10, 10) in heads  # 600 tokens in 64-token blocks, as vLLM asked the pool
