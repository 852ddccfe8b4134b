"""A Mamba hybrid's scrape against vLLM's real scheduler: tail waste only where vLLM's
pages hold token slots.

vLLM gives a Mamba group ``max_model_len``-token blocks without prefix caching and the
attention block size with it ("align" mode, a table as long as the attention group's,
its interior states nulled); either way each page is one recurrent state. The pool is
compared after every step (``PoolCheck``: the ledger's per-group figures against
``exactness.group_truth``), and the exposition's occupancy ratio equals vLLM's own tables'
(each group at its own block size: without prefix caching the scheduler's ``block_size``
is the groups' 1024, not the attention group's 32).
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.probed import ProbedTwin
from tests.twin.exactness import PoolCheck, group_truth

pytestmark = pytest.mark.twin


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["none", "align"])
def test_a_mamba_hybrids_waste_and_occupancy_follow_vllms_pages(prefix_caching: bool) -> None:
    cfg = TwinConfig(num_blocks=64, layout="mamba-hybrid", enable_prefix_caching=prefix_caching)
    probed = ProbedTwin(cfg, seed=2)
    check = PoolCheck(probed)
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(probed.hub))  # type: ignore[arg-type]
    kinds = [type(g.kv_cache_spec).__name__
             for g in probed.scheduler.kv_cache_config.kv_cache_groups]
    assert kinds == ["MambaSpec", "FullAttentionSpec"]
    seen: list[tuple[float, float, float]] = []
    occupancy: list[tuple[float, float]] = []

    checked = probed.scheduler.schedule  # PoolCheck's: the ledger drained and compared

    def scrape(*args: object, **kwargs: object) -> object:
        """Right after each schedule(), as PoolCheck compares: after the step's output
        vLLM has dropped finished requests the probe records freed at the next step."""
        out = checked(*args, **kwargs)
        if not probed.scheduler.running:
            return out
        waste, _, slots = group_truth(probed.scheduler)
        truth = 1.0 - sum(waste) / sum(slots) if sum(slots) else 1.0
        labels = {"server": "", "engine": probed.engine, "model": probed.state.hello.model}
        v = reg.get_sample_value
        seen.append((v("vllm_scheduler_kv_group_tail_waste_tokens",
                       {**labels, "kv_group": "0", "kind": "MambaSpec"}),
                     v("vllm_scheduler_tail_waste_tokens", labels),
                     v("vllm_scheduler_kv_token_occupancy_ratio", labels)))
        occupancy.append((seen[-1][2], truth))
        return out

    probed.scheduler.schedule = scrape

    reqs = generate(WorkloadSpec(n_requests=30, seed=2))
    result = probed.run(reqs)
    assert result.finished == 30 and check.steps == result.steps and check.preemptions > 0
    assert seen and all(mamba == 0 for mamba, _, _ in seen)
    assert all(0 <= occ <= 1 for _, _, occ in seen)
    assert [got for got, _ in occupancy] == [truth for _, truth in occupancy]
    assert any(total > 0 for _, total, _ in seen)  # the attention group's tails remain
