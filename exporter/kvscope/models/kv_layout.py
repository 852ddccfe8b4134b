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
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
"""``layer_types`` entries the twin can lay out, as its layer kinds."""
UNSUPPORTED = {
    "hybrid_override_pattern": "Mamba layers (hybrid_override_pattern, as Nemotron-H's)",
    "attn_layer_period": "Mamba layers (attn_layer_period, as Jamba's)",
    "layers_block_type": "Mamba layers (layers_block_type)",
    "mamba_d_state": "Mamba layers (mamba_d_state)",
    "ssm_state_size": "state-space layers (ssm_state_size)",
    "kv_lora_rank": "multi-head latent attention (kv_lora_rank, as DeepSeek's)",
    "attention_chunk_size": "chunked local attention (attention_chunk_size, as Llama 4's)",
}
"""config.json keys of layers whose KV cache is not full or sliding-window attention of
``2 x kv_heads x head_dim`` per token: sized as such, the pool would be off several times
over, so such a model is refused rather than laid out as full attention."""


@dataclass(frozen=True)
class KvModel:
    name: str
    kv_heads: int
    head_dim: int
    sliding_window: int | None
    """Tokens a sliding-window layer attends to; None: no layer slides."""
    layer_kinds: tuple[str, ...]
    """Each layer's kind in layer order (``full`` or ``sliding``): vLLM makes its KV cache
    groups from this pattern (``kvscope.twin.scheduler.model_fields``)."""
    max_position_embeddings: int
    dtype_bytes: int

    @property
    def layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def sliding_layers(self) -> int:
        """How many of ``layers`` slide (0: full attention only; ``layers``: all slide)."""
        return self.layer_kinds.count("sliding")

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
        """The TwinConfig fields this model sets, but its KV cache groups (which vLLM's
        planner makes of ``layer_kinds``: ``kvscope.twin.scheduler.model_fields``)."""
        out: dict[str, Any] = {"layout": self.layout,
                               "max_position_embeddings": self.max_position_embeddings}
        if self.sliding_window:
            out["sliding_window"] = self.sliding_window
        return out


def from_config(name: str, cfg: dict[str, Any]) -> KvModel:
    """The layout a Hugging Face config states (a multimodal one's ``text_config``)."""
    c = {**cfg, **cfg.get("text_config", {})}
    for key, what in UNSUPPORTED.items():
        if c.get(key):
            raise ValueError(f"it has {what}, which --model cannot lay out (full-attention "
                             "and sliding-window layers only); give the twin's --layout "
                             "and the pool in --blocks instead")
    layers = int(c["num_hidden_layers"])
    heads = int(c.get("num_attention_heads") or 1)
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    window = c.get("sliding_window")
    if c.get("use_sliding_window") is False:
        window = None
    kinds = layer_kinds(c, layers, window)
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    return KvModel(name, int(c.get("num_key_value_heads") or heads), head_dim,
                   int(window) if window and "sliding" in kinds else None, kinds,
                   int(c.get("max_position_embeddings") or 2048), DTYPE_BYTES.get(dtype, 2))


def layer_kinds(c: dict[str, Any], layers: int, window: Any) -> tuple[str, ...]:
    """Each layer's kind, as the config states it: ``layer_types`` (newer configs list
    each layer), Gemma 3's ``sliding_window_pattern`` (layer i is full where i + 1 is a
    multiple of it, as transformers builds its layer_types), else one kind for all."""
    if "layer_types" in c:
        other = sorted(set(c["layer_types"]) - set(LAYER_TYPES))
        if other:
            raise ValueError(f"it has layers of type {', '.join(other)}, which --model cannot "
                             "lay out (full_attention and sliding_attention only)")
        if len(c["layer_types"]) != layers:
            raise ValueError(f"layer_types lists {len(c['layer_types'])} layers, "
                             f"num_hidden_layers {layers}")
    if not window:
        return ("full",) * layers
    if "layer_types" in c:
        return tuple(LAYER_TYPES[t] for t in c["layer_types"])
    if c.get("sliding_window_pattern"):
        every = int(c["sliding_window_pattern"])
        return tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))
    return ("sliding",) * layers


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
