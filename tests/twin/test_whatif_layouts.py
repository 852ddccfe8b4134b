"""`kvscope whatif` compares KV layouts and schedulers as it compares block sizes.

Each column must be exactly what vLLM's scheduler does with that layout when run
directly, and what it cannot build (a pool too small for a layout) must be refused
with vLLM's reason before anything runs.
"""

from __future__ import annotations

import json

import pytest

from kvscope.twin.config import LAYOUTS, TwinConfig
from kvscope.twin.engine import Twin
from kvscope.twin.workload import WorkloadSpec, generate
from tests.twin.test_whatif import cli

pytestmark = pytest.mark.twin

SPEC = WorkloadSpec(n_requests=80, seed=2)


def test_layout_columns_equal_the_scheduler_run_directly(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--layout", "full,full+sliding,mamba-hybrid", "--blocks", "112",
                     "--sliding-window", "64", "--async-scheduling", "on",
                     "--spec-tokens", "2", "--requests", "80", "--seed", "2",
                     "--format", "json")
    assert rc == 0, out
    rows = {r["setting"]: r for r in json.loads(out)["settings"]}
    assert set(rows) == {f"layout:{name}" for name in LAYOUTS if name != "sliding"}
    requests = generate(SPEC)
    for name, row in rows.items():
        cfg = TwinConfig(num_blocks=112, layout=row["layout"], sliding_window=64,
                         async_scheduling=True, num_speculative_tokens=2)
        plain = Twin(cfg, seed=SPEC.seed).run(requests)
        assert (row["preemptions"], row["steps_to_drain"]) == (plain.preemptions, plain.steps)
        assert row["finished"] == len(requests) and row["drained"], name
        assert row["async_scheduling"] is True and row["num_speculative_tokens"] == 2
    assert len({r["steps_to_drain"] for r in rows.values()}) == 3  # the layouts differ


def test_a_pool_too_small_for_a_layout_is_refused_with_vllms_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = cli(capsys, "--layout", "full,full+sliding", "--blocks", "48",
                       "--requests", "10")
    assert rc == 2 and out == ""
    assert "vLLM refuses these settings" in err
    assert "setting layout:full+sliding: invalid TwinConfig: To serve at least one request" in err
    assert "setting layout:full:" not in err  # 48 blocks hold a 1024-token request


def test_kv_bytes_sizes_only_a_full_attention_pool(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = cli(capsys, "--layout", "sliding", "--kv-bytes", "4MiB", "--requests", "10")
    assert rc == 2
    assert "kv_bytes sizes a full-attention pool; give blocks or kv_tokens for layout sliding" \
        in err
