"""``kvscope whatif --model``: the served model's context and KV size, not the tiny one's.
Before ``--model``, a 32k context was refused ("the tiny model's positions")."""

from __future__ import annotations

import json

import pytest

from kvscope import cli
from kvscope.models import kv_layout
from kvscope.twin import TwinConfig
from kvscope.twin.scheduler import build_scheduler

pytestmark = pytest.mark.twin


def test_a_32k_context_and_a_100k_token_pool_run_on_the_models_layout(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = ["whatif", "--max-model-len", "32768", "--kv-bytes", "12GiB", "--block-size", "16",
            "--requests", "24", "--long-prompt", "4000:20000", "--short-fraction", "0.2",
            "--max-tokens", "16:64", "--budget", "8192", "--format", "json", "--quiet"]
    assert cli.main(args) == 2  # the tiny model: refused
    assert "the tiny model's positions" in capsys.readouterr().err
    assert cli.main([*args, "--model", "Llama-3.1-8B"]) == 0
    body = json.loads(capsys.readouterr().out)
    (col,) = body["settings"] if "settings" in body else body["columns"]
    per_token = kv_layout.load("Llama-3.1-8B").bytes_per_token()
    blocks = 12 * 2**30 // (per_token * 16)
    assert blocks == 6144  # 12 GiB of Llama 3.1 8B KV: 98304 tokens
    assert col["num_blocks"] == blocks and col["block_size"] == 16
    assert col["usable_kv_tokens"] == (blocks - 1) * 16
    assert col["drained"] is True and col["faults"] == 0


def test_the_scheduler_takes_the_models_context() -> None:
    m = kv_layout.load("Gemma-3-12B")
    cfg = TwinConfig(max_model_len=32768, num_blocks=4000, block_size=16, **m.twin_fields())
    s = build_scheduler(cfg)
    assert s.max_model_len == 32768
    assert s.vllm_config.model_config.max_model_len == 32768
    kinds = {type(g.kv_cache_spec).__name__ for g in s.kv_cache_config.kv_cache_groups}
    assert kinds == {"FullAttentionSpec", "SlidingWindowSpec"}
