"""The twin rebuilt from an engine's hello alone: vLLM's real scheduler, built under each KV
layout and scheduler the twin knows, reports itself through the probe's hello; the
sidecar's ``engine_configs`` row of it, turned back into settings
(``kvscope.whatif.engine_settings``), must give the very TwinConfig it was built from.
This also checks ``LAYOUT_GROUPS`` against the groups vLLM's planner really builds, and
that a twin given an engine's own groups (one stand-in layer a group) gets exactly them."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from kvscope.state.requests import engine_config
from kvscope.twin.config import GROUP_OF_SPEC, LAYOUTS, TwinConfig
from kvscope.whatif.engine_settings import LAYOUT_GROUPS, from_config

pytestmark = pytest.mark.twin
GROUP_SPEC = {group: spec for spec, group in GROUP_OF_SPEC.items()}

CONFIGS = [  # every layout, and each other value at least once
    TwinConfig(layout="full", num_blocks=300, block_size=16, max_num_seqs=24,
               max_num_batched_tokens=384, max_model_len=2048, async_scheduling=True,
               watermark=0.05),
    TwinConfig(layout="full+sliding", num_blocks=200, sliding_window=64, policy="priority",
               num_speculative_tokens=2),
    TwinConfig(layout="sliding", num_blocks=120, sliding_window=256,
               enable_prefix_caching=False, async_scheduling=True, num_speculative_tokens=1),
    TwinConfig(layout="mamba-hybrid", num_blocks=160, policy="priority"),
    TwinConfig(layout="full", num_blocks=100, max_num_batched_tokens=512,
               max_num_scheduled_tokens=384),  # --max-num-scheduled-tokens
]
GROUPED = [  # groups other than the stand-ins': a Gemma 3's 5:1, either order, two Mamba
    TwinConfig(layout="full+sliding", groups=("sliding",) * 5 + ("full",), num_blocks=400),
    TwinConfig(layout="full+sliding", groups=("full", "sliding"), num_blocks=200,
               async_scheduling=True),
    TwinConfig(layout="mamba-hybrid", groups=("mamba", "mamba", "full"), num_blocks=240),
]


def test_the_configs_cover_every_layout() -> None:
    assert sorted(set(c.layout for c in CONFIGS)) == sorted(LAYOUTS) == sorted(LAYOUT_GROUPS)


@pytest.mark.parametrize("cfg", CONFIGS + GROUPED,
                         ids=[c.layout + "".join(f"-{g}" for g in c.groups)
                              for c in CONFIGS + GROUPED])
def test_a_twin_is_rebuilt_from_its_hello(cfg: TwinConfig) -> None:
    from kvscope.twin.probed import ProbedTwin

    pt = ProbedTwin(cfg)
    pt.drain()
    row = asdict(engine_config(pt.state))
    kinds = [GROUP_SPEC[g] for g in cfg.groups] or list(LAYOUT_GROUPS[cfg.layout])
    assert row["kv_group_kinds"] == kinds
    assert row["token_budget"] == (cfg.max_num_scheduled_tokens or cfg.max_num_batched_tokens)
    rebuilt = from_config(row).config()
    if cfg.layout not in ("full+sliding", "sliding"):  # no sliding group: no window to read
        rebuilt = replace(rebuilt, sliding_window=cfg.sliding_window)
    assert rebuilt == cfg
    again = ProbedTwin(rebuilt)
    again.drain()
    assert asdict(engine_config(again.state))["token_budget"] == row["token_budget"]


@pytest.mark.parametrize(("watermark", "blocks"), [(0.37, 251), (0.01, 1000), (0.999, 97)])
def test_a_replay_keeps_the_watermark_vllm_held_back(watermark: float, blocks: int) -> None:
    """The replay ignored ``--watermark``: vLLM refused a waiting request unless its blocks
    and the watermark's were free, the replay admitted it. The hello carries vLLM's own
    ``watermark_blocks``; the rebuilt twin's KV cache manager holds back exactly as many."""
    from kvscope.twin.probed import ProbedTwin

    pt = ProbedTwin(TwinConfig(num_blocks=blocks, watermark=watermark))
    pt.drain()
    held = pt.twin.scheduler.kv_cache_manager.watermark_blocks
    assert held == int(watermark * blocks) > 0
    row = asdict(engine_config(pt.state))
    assert row["watermark_blocks"] == held
    again = ProbedTwin(from_config(row).config())
    assert again.twin.scheduler.kv_cache_manager.watermark_blocks == held


def test_a_replay_budgets_each_step_as_the_engine_did() -> None:
    """vLLM 0.32 budgets a step by ``max_num_scheduled_tokens``
    (``--max-num-scheduled-tokens``, the hello's ``token_budget``), not by
    ``max_num_batched_tokens``: an engine run with a smaller step budget was replayed at
    the larger one. The rebuilt twin's real scheduler gives a long prompt's first chunk
    exactly the engine's budget."""
    from kvscope.twin.engine import Twin
    from kvscope.twin.workload import TwinRequest

    row = {"num_blocks": 200, "block_size": 16, "kv_group_kinds": ["FullAttentionSpec"],
           "kv_group_block_sizes": [16], "kv_group_windows": [0],
           "max_num_batched_tokens": 512, "token_budget": 384, "max_num_seqs": 8,
           "max_model_len": 1024, "policy": "fcfs", "prefix_caching": True,
           "async_scheduling": False, "spec_tokens": 0}
    twin = Twin(from_config(row).config())
    assert twin.scheduler.max_num_scheduled_tokens == 384
    twin.add(TwinRequest("long", tuple(range(1, 901)), 4, 0, 0))
    assert twin.step().total_num_scheduled_tokens == 384
