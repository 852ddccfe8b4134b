"""A served model's KV layout from its ``config.json`` (a local directory or file, or a
well-known model of ``known.KNOWN``): layers, KV heads, head size, which layers slide and
over how many tokens, the longest context. What the twin needs to build vLLM's scheduler
for that model instead of the tiny one; no weights are read, nothing is downloaded.

A ``config.json`` is read as vLLM reads it: through vLLM's config loader, which builds the
model type's config class with that class's defaults for what the file leaves out
(Gemma 2's published file states no ``layer_types``; its class alternates sliding and
full layers). A file naming no ``model_type``, or one vLLM's loader refuses, is read as
written (``KvModel.read_by`` says which).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.models.known import KNOWN

DTYPE_BYTES = {"float32": 2, "float16": 2, "bfloat16": 2, "float8": 1, "fp8": 1}
"""KV cache bytes per value by the config's dtype, as vLLM serves it with ``--dtype auto``
(and ``--kv-cache-dtype auto``): a float32 model is downcast to the platform's preferred
16-bit type (``vllm/config/model.py``, ``_resolve_auto_dtype``), so its KV takes 2 bytes."""
READ_BY_VLLM = "vLLM's config loader"
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
    read_by: str = "kvscope's list of known models"
    """How the config was read: ``READ_BY_VLLM``, or as written and why."""

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


def from_config(name: str, cfg: dict[str, Any], read_by: str = "as written") -> KvModel:
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
                   int(c.get("max_position_embeddings") or 2048), DTYPE_BYTES.get(dtype, 2),
                   read_by)


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
        return from_config(spec, KNOWN[spec], KvModel.read_by)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--model {spec!r}: no such config.json or model directory, and "
                         f"not a known model ({', '.join(KNOWN)})")
    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            raise TypeError("not a JSON object")
        read_by, cfg = as_vllm_reads(path, cfg)
        return from_config(path.parent.name, cfg, read_by)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"--model {spec!r}: not a usable config.json ({exc})") from None


def as_vllm_reads(path: Path, cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``cfg`` (read from ``path``) as vLLM's config loader makes it, every default of its
    model type's config class filled in, and ``READ_BY_VLLM``; else ``cfg`` as written and
    why. vLLM is imported here only (whatif's and explain's ``--model`` run its planner
    next); a model's own code (``auto_map``) is never run."""
    if not cfg.get("model_type"):
        return "as written (it names no model_type)", cfg
    try:
        from vllm.transformers_utils.config import get_config
    except ImportError:
        return "as written (vLLM is not installed)", cfg
    with tempfile.TemporaryDirectory(prefix="kvscope-model-") as tmp:
        where = path.parent
        if path.name != "config.json":  # vLLM reads a model directory's config.json
            where = Path(tmp)
            (where / "config.json").write_text(json.dumps(cfg))
        try:
            loaded = get_config(str(where), trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 - any refusal: read as written, said so
            return f"as written (vLLM's config loader refused it: {type(exc).__name__})", cfg
    return READ_BY_VLLM, loaded.to_dict()
