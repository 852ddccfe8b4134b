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


# google/gemma-2-9b's config.json as published (huggingface.co/google/gemma-2-9b): no
# layer_types; transformers' Gemma2Config alternates sliding and full layers by default.
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
    "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
    "num_hidden_layers": 42, "num_key_value_heads": 8, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
    "sliding_window_size": 4096, "torch_dtype": "float32", "vocab_size": 256000}
# a Gemma 3 text config that leaves the pattern, the window and the KV heads to
# Gemma3TextConfig's defaults
GEMMA_3_DEFAULTS = {"model_type": "gemma3_text", "num_hidden_layers": 12,
                    "num_attention_heads": 8, "hidden_size": 640,
                    "max_position_embeddings": 32768}


@pytest.mark.parametrize("cfg", [GEMMA_2_9B, GEMMA_3_DEFAULTS], ids=["gemma2", "gemma3"])
def test_a_config_is_read_as_vllm_reads_it(tmp_path, cfg: dict) -> None:
    """vLLM reads config.json through its config loader (transformers' config class for
    the model_type, with that class's defaults): Gemma 2 9B's file states no layer_types
    and vLLM lays it out as 21 sliding and 21 full layers. Read as written, --model laid
    out 42 sliding layers (a full-attention half of the pool missing)."""
    from vllm.transformers_utils.config import get_config

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    vllm_cfg = get_config(str(tmp_path), trust_remote_code=False)
    vllm_cfg = getattr(vllm_cfg, "text_config", vllm_cfg)
    kinds = tuple(kv_layout.LAYER_TYPES[t] for t in vllm_cfg.layer_types)
    assert len(set(kinds)) == 2
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        m = kv_layout.load(spec)
        assert m.layer_kinds == kinds
        assert (m.sliding_window, m.kv_heads, m.head_dim) == (
            vllm_cfg.sliding_window, vllm_cfg.num_key_value_heads, vllm_cfg.head_dim)
        assert m.read_by == "vLLM's config loader"


def test_a_float32_models_kv_takes_the_16_bit_type_vllm_serves_it_in(tmp_path) -> None:
    """Gemma 2 9B's file says float32; vLLM (``--dtype auto``) downcasts a float32 model
    to the platform's preferred 16-bit type, so its KV takes 2 bytes a value, not 4 (the
    pool was read at half the tokens)."""
    import torch
    from vllm.config.model import _resolve_auto_dtype

    served = _resolve_auto_dtype("gemma2", torch.float32, is_pooling_model=False)
    assert served in (torch.bfloat16, torch.float16)
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_2_9B))
    m = kv_layout.load(str(tmp_path))
    assert m.dtype_bytes == served.itemsize == 2
    assert m.bytes_per_token() == 2 * 42 * 8 * 256 * 2


def test_a_config_read_as_written_is_said_in_the_answer(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {k: v for k, v in GEMMA_2_9B.items() if k != "model_type"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kv_layout.load(str(tmp_path)).read_by == "as written (it names no model_type)"
    assert cli.main(["whatif", "--model", str(tmp_path), "--blocks", "2000", "--requests",
                     "4", "--format", "json", "--quiet"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert [n for n in notes if "read as written (it names no model_type)" in n] == [
        f"--model {tmp_path}: config.json read as written (it names no model_type); the "
        "defaults vLLM's loader gives what the file leaves out were not applied"]
