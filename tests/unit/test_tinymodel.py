"""The tiny Llama's config: the fields vLLM's ModelConfig and the CPU backend rely on.

``make_tiny_model`` (torch, a few seconds) is exercised by the engine tests that serve it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.models.config import VOCAB_SIZE, default_cache_dir, write_llama_config
from kvscope.models.tiny import is_complete


def test_write_llama_config_writes_the_tiny_llama(tmp_path: Path) -> None:
    out = write_llama_config(tmp_path / "m")
    assert out == tmp_path / "m"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert 930 <= cfg["vocab_size"] == VOCAB_SIZE <= 1024
    expected = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 4096,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["head_dim"] * cfg["num_attention_heads"] == cfg["hidden_size"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json"]


def test_write_llama_config_is_idempotent_and_repairs(tmp_path: Path) -> None:
    out = write_llama_config(tmp_path)
    first = (out / "config.json").read_text()
    (out / "config.json").write_text("{}")
    write_llama_config(tmp_path)
    assert (out / "config.json").read_text() == first
    assert not is_complete(out)  # a config alone is not a servable model


def test_default_cache_dir_honours_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("KVSCOPE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "kvscope"


def test_light_modules_import_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, kvscope, kvscope.twin, kvscope.models.tiny\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == ""
