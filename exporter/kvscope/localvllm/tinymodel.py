"""A tiny random Llama (or Gemma 3) that vLLM can load and serve on the CPU, built offline.

No model can be downloaded where kvscope's tests run, so the engine tests serve a
2-layer Llama with random weights and a word-level tokenizer whose words are
``w0`` .. ``w899`` plus a few English words. Its output is noise; what matters is
that vLLM's real scheduler and KV-cache manager handle real requests. ``kind="gemma3"``
builds a 4-layer Gemma 3 text model instead, its sliding-window and full-attention layers
interleaved, for which vLLM builds two KV cache groups over one pool (a hybrid layout).

``write_llama_config`` writes only the JSON config (enough for vLLM's
``ModelConfig``, which the in-process twin needs); ``make_tiny_model`` writes the
full servable model. Neither imports vLLM; only ``make_tiny_model`` imports torch
and transformers, lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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

WEIGHTS_FILE = "model.safetensors"
STAMP_FILE = ".kvscope-tinymodel"
_STAMP_VERSION = 1

_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
)


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


def write_llama_config(dir: Path, kind: str = "llama") -> Path:
    """Write ``config.json`` and ``generation_config.json`` for the tiny Llama (or the
    ``kind`` of ``MODELS``) into ``dir``.

    Enough for ``vllm.config.ModelConfig(model=dir, skip_tokenizer_init=True)``; no
    weights and no tokenizer. Returns ``dir``.
    """
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    _write_json_atomically(dir / "config.json", MODELS[kind][0]())
    _write_json_atomically(dir / "generation_config.json", _generation_config())
    return dir


def _stamp(kind: str = "llama") -> str:
    """Identifies what ``make_tiny_model`` writes; a change forces a rebuild."""
    payload = json.dumps([_STAMP_VERSION, MODELS[kind][0](), EXTRA_WORDS], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def is_complete(dir: Path, kind: str = "llama") -> bool:
    """True when ``dir`` holds a full model written by this version of ``make_tiny_model``."""
    dir = Path(dir)
    stamp = dir / STAMP_FILE
    if not stamp.is_file() or stamp.read_text().strip() != _stamp(kind):
        return False
    return all((dir / name).is_file() for name in _REQUIRED_FILES)


def _write_tokenizer(dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [*SPECIAL_TOKENS, *(f"w{i}" for i in range(NUM_WORDS)), *EXTRA_WORDS]
    vocab = {word: i for i, word in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    if len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(fast)} tokens, expected {VOCAB_SIZE}")
    fast.save_pretrained(str(dir))


def _write_weights(dir: Path, seed: int, kind: str) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    config, config_cls, model_cls = MODELS[kind]
    torch.manual_seed(seed)
    hf_config = getattr(transformers, config_cls)(**config())
    model = getattr(transformers, model_cls)(hf_config)
    tensors: dict[str, Any] = {}
    stored: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in stored:  # a tied copy (Gemma's lm_head is its embedding)
            continue
        stored.add(t.data_ptr())
        tensors[name] = t.detach().contiguous()
    save_file(tensors, str(dir / WEIGHTS_FILE), metadata={"format": "pt"})


def make_tiny_model(dir: Path, seed: int = 0, kind: str = "llama") -> Path:
    """Write the full tiny Llama, or the ``kind`` of ``MODELS`` (config, safetensors
    weights, tokenizer) into ``dir``.

    Deterministic for a ``seed``. Returns at once when ``dir`` is already complete.
    The model is built in a sibling temporary directory and renamed into place, so
    a reader never sees half a model and concurrent callers do not clash.
    """
    dir = Path(dir)
    if is_complete(dir, kind):
        return dir
    dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dir.parent, prefix=f".{dir.name}."))
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700
    try:
        write_llama_config(tmp, kind)
        _write_tokenizer(tmp)
        _write_weights(tmp, seed, kind)
        (tmp / STAMP_FILE).write_text(_stamp(kind) + "\n")
        for path in tmp.iterdir():
            os.chmod(path, 0o644)  # some writers create 0600; the model is shared, not secret
        _move_into_place(tmp, dir, kind)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dir


def _move_into_place(tmp: Path, dir: Path, kind: str) -> None:
    """Rename ``tmp`` to ``dir``, replacing a stale ``dir``; a concurrent winner is kept."""
    if dir.exists() and not is_complete(dir, kind):
        stale = Path(tempfile.mkdtemp(dir=dir.parent, prefix=f".{dir.name}.stale."))
        try:
            os.replace(dir, stale / "old")
        except FileNotFoundError:
            pass  # another caller removed it first
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, dir)
    except OSError:
        if not is_complete(dir, kind):  # not a concurrent build that got there first
            raise
