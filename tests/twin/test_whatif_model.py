"""``kvscope whatif --model``: the served model's context and KV size, not the tiny one's.
Before ``--model``, a 32k context was refused ("the tiny model's positions")."""

from __future__ import annotations

import json

import pytest

from kvscope import cli
from kvscope.models import kv_layout
from kvscope.twin import TwinConfig
from kvscope.twin.kv_layout import group_kind
from kvscope.twin.scheduler import build_scheduler, model_fields

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


@pytest.mark.parametrize(("name", "layers", "groups"), [
    ("Gemma-3-12B", None, ("sliding",) * 5 + ("full",)),
    ("alternating", ("sliding", "full") * 12, ("sliding", "full")),
])
def test_a_hybrid_models_kv_cache_groups_are_the_ones_vllm_makes_of_its_layers(
        name: str, layers: tuple[str, ...] | None, groups: tuple[str, ...]) -> None:
    """vLLM makes one KV cache group per layer of a model's repeating pattern
    (kv_cache_utils: 40 sliding-window and 8 full layers are 6 groups), and each request
    holds blocks in every group. ``--model`` used the twin's stand-in (two sliding, one
    full) for every such model."""
    if layers is None:
        model = kv_layout.load(name)
    else:
        model = kv_layout.from_config(name, {
            "num_hidden_layers": len(layers), "num_attention_heads": 8, "hidden_size": 512,
            "sliding_window": 128, "max_position_embeddings": 8192,
            "layer_types": [f"{k}_attention" for k in layers]})
    fields = model_fields(model)
    assert fields["groups"] == groups
    # vLLM's planner over every layer of the model makes the same groups the twin builds
    whole = build_scheduler(TwinConfig(num_blocks=4000, block_size=16,
                                       **{**fields, "groups": model.layer_kinds}))
    twin = build_scheduler(TwinConfig(num_blocks=4000, block_size=16, **fields))
    for s in (whole, twin):
        assert tuple(group_kind(g.kv_cache_spec)
                     for g in s.kv_cache_config.kv_cache_groups) == groups
