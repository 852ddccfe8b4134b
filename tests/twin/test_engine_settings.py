"""The twin rebuilt from an engine's hello alone: vLLM's real scheduler, built under each KV
layout and scheduler the twin knows, reports itself through the probe's hello; the
sidecar's ``engine_configs`` row of it, turned back into settings
(``kvscope.whatif.engine_settings``), must give the very TwinConfig it was built from.
This also checks ``LAYOUT_GROUPS`` against the groups vLLM's planner really builds."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from kvscope.state.requests import engine_config
from kvscope.twin.config import LAYOUTS, TwinConfig
from kvscope.whatif.engine_settings import LAYOUT_GROUPS, from_config
from kvscope.whatif.settings import KEYS, build

pytestmark = pytest.mark.twin

CONFIGS = [  # every layout, and each other value at least once
    TwinConfig(layout="full", num_blocks=300, block_size=16, max_num_seqs=24,
               max_num_batched_tokens=384, max_model_len=2048, async_scheduling=True),
    TwinConfig(layout="full+sliding", num_blocks=200, sliding_window=64, policy="priority",
               num_speculative_tokens=2),
    TwinConfig(layout="sliding", num_blocks=120, sliding_window=256,
               enable_prefix_caching=False, async_scheduling=True, num_speculative_tokens=1),
    TwinConfig(layout="mamba-hybrid", num_blocks=160, policy="priority"),
]


def test_the_configs_cover_every_layout() -> None:
    assert sorted(c.layout for c in CONFIGS) == sorted(LAYOUTS) == sorted(LAYOUT_GROUPS)


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.layout for c in CONFIGS])
def test_a_twin_is_rebuilt_from_its_hello(cfg: TwinConfig) -> None:
    from kvscope.twin.probed import ProbedTwin

    pt = ProbedTwin(cfg)
    pt.drain()
    row = asdict(engine_config(pt.state))
    assert row["kv_group_kinds"] == list(LAYOUT_GROUPS[cfg.layout])
    got = from_config(row)
    errors: list[str] = []
    (setting,) = build({k: [] for k in KEYS}, [f"server={got.spec}"],
                       max_model_len=got.max_model_len, bytes_per_token=1, errors=errors,
                       model=got.model)
    assert errors == []
    rebuilt = setting.config
    if cfg.layout not in ("full+sliding", "sliding"):  # no sliding group: no window to read
        rebuilt = replace(rebuilt, sliding_window=cfg.sliding_window)
    assert rebuilt == cfg
