"""The tiny models' configs: a 2-layer Llama and a 4-layer Gemma 3 (sliding-window and
full-attention layers interleaved, two KV cache groups over one pool), and the word-level
vocabulary they share.

``write_llama_config`` writes only the JSON config: enough for vLLM's ``ModelConfig``,
which the in-process twin builds its scheduler from. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
"""Special tokens; their ids are their positions (0..3)."""

NUM_WORDS = 900
"""Words ``w0`` .. ``w899``: the vocabulary workloads draw prompts from."""

EXTRA_WORDS = tuple(
    "the a of to and in is it you that he was for on are with as I his they be at one "
    "have this from".split()
)
"""A few English words, so hand-written prompts tokenize to something."""

VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_WORDS + len(EXTRA_WORDS)
"""930: the tokenizer's vocabulary and the model's embedding rows."""

MAX_POSITION_EMBEDDINGS = 4096
"""The longest ``max_model_len`` a server or twin may use with this model."""

def default_cache_dir() -> Path:
    """Where kvscope keeps generated models: ``$KVSCOPE_CACHE_DIR`` or ``~/.cache/kvscope``."""
    override = os.environ.get("KVSCOPE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "kvscope"


def llama_config() -> dict[str, Any]:
    """The tiny Llama's Hugging Face config, as a plain dict."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # the CPU attention backend's smallest supported head size
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "dtype": "float32",
        "use_cache": True,
    }


GEMMA3_SLIDING_WINDOW = 64
"""Tokens the tiny Gemma 3's sliding-window layers attend to: two 32-token blocks."""


def gemma3_config() -> dict[str, Any]:
    """The tiny Gemma 3 text model's Hugging Face config: sliding, full, sliding, full."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # the CPU attention backend's smallest supported head size
        "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": GEMMA3_SLIDING_WINDOW,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "dtype": "float32",
        "use_cache": True,
    }


MODELS: dict[str, tuple[Any, str, str]] = {
    "llama": (llama_config, "LlamaConfig", "LlamaForCausalLM"),
    "gemma3": (gemma3_config, "Gemma3TextConfig", "Gemma3ForCausalLM"),
}
"""Kind -> (its config, transformers' config class, transformers' model class)."""


def _generation_config() -> dict[str, Any]:
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` unless ``path`` already holds it; concurrent writers never tear it."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    if path.is_file() and path.read_text() == text:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; the model dir is shared, not secret
    os.replace(tmp, path)


def write_llama_config(dir: Path, kind: str = "llama",
                       max_position_embeddings: int = MAX_POSITION_EMBEDDINGS) -> Path:
    """Write ``config.json`` and ``generation_config.json`` for the tiny Llama (or the
    ``kind`` of ``MODELS``) into ``dir``; ``max_position_embeddings`` stands in for a
    served model's context (the twin's scheduler reads nothing else of the model).

    Enough for ``vllm.config.ModelConfig(model=dir, skip_tokenizer_init=True)``; no
    weights and no tokenizer. Returns ``dir``.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    _write_json_atomically(dir / "config.json", {
        **MODELS[kind][0](), "max_position_embeddings": max_position_embeddings})
    _write_json_atomically(dir / "generation_config.json", _generation_config())
    return dir
