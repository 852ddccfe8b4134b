"""A served model's KV layout from its config.json or the known list: the twin's layout,
window and context, and the bytes a token takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.models import kv_layout
from kvscope.models.known import KNOWN
from kvscope.twin.config import LAYOUTS, TwinConfig


def test_known_models_map_to_the_twin_layouts() -> None:
    got = {name: kv_layout.load(name) for name in KNOWN}
    assert {n: m.layout for n, m in got.items()} == {
        "Llama-3-8B": "full", "Llama-3.1-8B": "full", "Mistral-7B-v0.1": "sliding",
        "Mistral-7B-v0.3": "full", "Qwen2.5-7B": "full", "Gemma-3-12B": "full+sliding",
        "Gemma-3-27B": "full+sliding"}
    assert all(m.layout in LAYOUTS for m in got.values())
    # Llama 3 8B: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert got["Llama-3-8B"].bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert got["Qwen2.5-7B"].bytes_per_token() == 2 * 28 * 4 * 128 * 2
    g = got["Gemma-3-12B"]
    assert (g.sliding_layers, g.sliding_window, g.head_dim) == (40, 1024, 256)
    assert got["Mistral-7B-v0.1"].twin_fields() == {
        "layout": "sliding", "max_position_embeddings": 32768, "sliding_window": 4096}


def test_a_model_directory_or_its_config_json(tmp_path: Path) -> None:
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_size": 512, "max_position_embeddings": 65536, "torch_dtype": "float16",
           "layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 512}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        m = kv_layout.load(spec)
        assert (m.layout, m.sliding_layers, m.head_dim, m.kv_heads) == ("full+sliding", 2, 64, 2)
        assert m.bytes_per_token() == 2 * 4 * 2 * 64 * 2
        assert TwinConfig(max_model_len=65536, num_blocks=65536 // 32 + 2,
                          **m.twin_fields()).validate() == []
    with pytest.raises(ValueError, match="not a known model"):
        kv_layout.load(str(tmp_path / "nope"))


def test_max_model_len_is_bounded_by_the_models_context() -> None:
    (err,) = TwinConfig(max_model_len=32768, num_blocks=1100).validate()
    assert "between 1 and 4096 (the tiny model's positions" in err
    ok = TwinConfig(max_model_len=32768, num_blocks=1100, max_position_embeddings=32768)
    assert ok.validate() == []
    (err,) = TwinConfig(max_model_len=40000, num_blocks=1300,
                        max_position_embeddings=32768).validate()
    assert "between 1 and 32768 (the model's max_position_embeddings)" in err


def test_each_layer_is_laid_out_as_the_config_states_it() -> None:
    """Gemma 3 states a pattern (layer i is full where i + 1 is a multiple of 6, as
    transformers builds its layer_types); newer configs list each layer."""
    g = kv_layout.load("Gemma-3-12B")
    assert len(g.layer_kinds) == 48
    assert [i for i, k in enumerate(g.layer_kinds) if k == "full"] == list(range(5, 48, 6))
    alternating = kv_layout.from_config("alternating", {
        "num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2})
    assert alternating.layer_kinds == ("sliding", "full", "sliding", "full")
    assert kv_layout.load("Llama-3-8B").layer_kinds == ("full",) * 32


@pytest.mark.parametrize(("extra", "named"), [
    ({"hybrid_override_pattern": "M-M*-M-"}, "Mamba"),
    ({"attn_layer_period": 8, "attn_layer_offset": 4}, "Mamba"),
    ({"kv_lora_rank": 512}, "multi-head latent attention"),
    ({"attention_chunk_size": 8192}, "chunked local attention"),
    ({"layer_types": ["linear_attention", "full_attention"] * 2}, "linear_attention"),
])
def test_layers_that_are_not_full_or_sliding_attention_are_refused(
        tmp_path: Path, extra: dict[str, object], named: str) -> None:
    """Sized as full attention (2 x kv_heads x head_dim per token in every layer), a Mamba
    or MLA model's pool was off several times over, silently."""
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_size": 512, "max_position_embeddings": 4096, **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=named) as err:
        kv_layout.load(str(tmp_path))
    assert "cannot lay out" in str(err.value)
