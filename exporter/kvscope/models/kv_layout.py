"""A served model's KV layout from its ``config.json`` (a local directory or file, or a
well-known model of ``known.KNOWN``): layers, KV heads, head size, which layers slide and
over how many tokens, the longest context. What the twin needs to build vLLM's scheduler
for that model instead of the tiny one; no weights are read, nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.models.known import KNOWN

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1}


@dataclass(frozen=True)
class KvModel:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    """Tokens a sliding-window layer attends to; None: no layer slides."""
    sliding_layers: int
    """How many of ``layers`` slide (0: full attention only; ``layers``: all slide)."""
    max_position_embeddings: int
    dtype_bytes: int

    @property
    def layout(self) -> str:
        """The twin's name for this KV layout (``kvscope.twin.config.LAYOUTS``)."""
        if not self.sliding_layers:
            return "full"
        return "sliding" if self.sliding_layers == self.layers else "full+sliding"

    def bytes_per_token(self) -> int:
        """KV bytes one token takes in every layer (K and V), sliding ones included."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def twin_fields(self) -> dict[str, Any]:
        """The TwinConfig fields this model sets."""
        out: dict[str, Any] = {"layout": self.layout,
                               "max_position_embeddings": self.max_position_embeddings}
        if self.sliding_window:
            out["sliding_window"] = self.sliding_window
        return out


def from_config(name: str, cfg: dict[str, Any]) -> KvModel:
    """The layout a Hugging Face config states (a multimodal one's ``text_config``)."""
    c = {**cfg, **cfg.get("text_config", {})}
    layers = int(c["num_hidden_layers"])
    heads = int(c.get("num_attention_heads") or 1)
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    window = c.get("sliding_window")
    if c.get("use_sliding_window") is False:
        window = None
    if "layer_types" in c:  # newer configs list each layer
        sliding = sum(t == "sliding_attention" for t in c["layer_types"])
    elif window and c.get("sliding_window_pattern"):  # Gemma 3: every Nth layer is full
        sliding = layers - layers // int(c["sliding_window_pattern"])
    else:
        sliding = layers if window else 0
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    return KvModel(name, layers, int(c.get("num_key_value_heads") or heads), head_dim,
                   int(window) if window and sliding else None, sliding,
                   int(c.get("max_position_embeddings") or 2048), DTYPE_BYTES.get(dtype, 2))


def load(spec: str) -> KvModel:
    """``spec``: a name of ``KNOWN``, a model directory, or a ``config.json`` path.
    ``ValueError`` with the choices when it is none of them."""
    if spec in KNOWN:
        return from_config(spec, KNOWN[spec])
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {spec!r}: no such config.json or model directory, and "
                         f"not a known model ({', '.join(KNOWN)})")
    try:
        return from_config(path.parent.name, json.loads(path.read_text()))
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"--model {spec!r}: not a usable config.json ({exc})") from None
