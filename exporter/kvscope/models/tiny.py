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

from kvscope.models.config import (
    EXTRA_WORDS,
    MAX_POSITION_EMBEDDINGS,
    MODELS,
    NUM_WORDS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    write_llama_config,
)

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
