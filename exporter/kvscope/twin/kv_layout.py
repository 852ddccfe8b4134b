"""The KV layouts the twin builds: a stand-in model's layers, grouped by vLLM's planner.

A real engine asks each worker for one ``KVCacheSpec`` per attention layer, then vLLM's
planner (``get_kv_cache_configs``) groups the layers into KV cache groups over one
shared block pool and sizes the pool (``--num-gpu-blocks-override`` pins its size). The
twin does the same with the layers below in place of a model's: the groups, their block
sizes and the pool are vLLM's own construction, and vLLM's own check refuses a pool that
cannot hold one ``max_model_len`` request, as a server refuses to start.

A Mamba hybrid needs no model either: ``MambaModelConfig.verify_and_update_config``
(``model_executor/models/config.py``) sets the cache mode and Mamba block size from the
cache config alone, ``MambaSpec`` (``v1/kv_cache_interface.py``) takes plain shapes, and
the scheduler runs ``MambaManager`` (``v1/core/single_type_kv_cache_manager.py``) on them.
"""

from __future__ import annotations

from kvscope.models.config import llama_config
from kvscope.twin._vllm import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaModelConfig,
    MambaSpec,
    SlidingWindowSpec,
    VllmConfig,
    plan_kv_cache,
    torch,
)
from kvscope.twin.config import GROUP_OF_SPEC, Layout, TwinConfig

LAYERS: dict[Layout, tuple[str, ...]] = {
    "full": ("full", "full"),
    "full+sliding": ("sliding", "sliding", "full"),
    "sliding": ("sliding", "sliding"),
    "mamba-hybrid": ("mamba", "full", "mamba", "full"),
}
"""Layer kinds of each layout's stand-in model, in layer order. vLLM groups layers of one
kind into groups of equal size: ``full+sliding`` becomes three groups (two sliding-window,
one full), ``mamba-hybrid`` two (Mamba, full), the others one."""

KV_CACHE_LAYOUT = "NHD"
"""The engine resolves a tensor layout from its attention backends before planning; no
block-allocation decision depends on it, so the twin names the common one."""


def layer_specs(cfg: TwinConfig, config: VllmConfig) -> dict[str, KVCacheSpec]:
    """One vLLM ``KVCacheSpec`` per layer of ``cfg.layout``'s stand-in model, or one per
    group of ``cfg.groups``."""
    model = llama_config()
    attention = {
        "block_size": cfg.block_size,
        "num_kv_heads": model["num_key_value_heads"],
        "head_size": model["head_dim"],
        "dtype": torch.float32,
    }
    kinds = cfg.groups or LAYERS[cfg.layout]
    if "mamba" in kinds:
        # What vLLM runs for a Mamba-hybrid architecture: the Mamba cache mode ("align"
        # with prefix caching, else "none") and the Mamba block size follow from it.
        MambaModelConfig.verify_and_update_config(config)
    specs: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(kinds):
        if kind == "full":
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(**attention)
        elif kind == "sliding":
            specs[f"model.layers.{i}.self_attn.attn"] = SlidingWindowSpec(
                **attention, sliding_window=cfg.sliding_window
            )
        else:
            specs[f"model.layers.{i}.mixer"] = _mamba_spec(attention, config)
    return specs


def group_kind(spec: KVCacheSpec) -> str:
    """The twin's kind (``full``, ``sliding``, ``mamba``) of a KV cache group's spec."""
    name = type(spec).__name__
    if name not in GROUP_OF_SPEC:
        raise ValueError(f"a KV cache group of {name}, which the twin does not build")
    return GROUP_OF_SPEC[name]


def _mamba_spec(attention: dict[str, object], config: VllmConfig) -> MambaSpec:
    """A Mamba layer whose state page is exactly one attention page, as vLLM pads pages
    of a hybrid model to be equal (a block of the shared pool holds either)."""
    page_bytes = FullAttentionSpec(**attention).page_size_bytes  # type: ignore[arg-type]
    cache = config.cache_config
    return MambaSpec(
        shapes=((page_bytes // 4,),),
        dtypes=(torch.float32,),
        block_size=cache.mamba_block_size,
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=config.num_speculative_tokens,
    )


def kv_cache_config(cfg: TwinConfig, config: VllmConfig) -> KVCacheConfig:
    """The scheduler's ``KVCacheConfig`` for ``cfg``: vLLM's planner over ``layer_specs``.

    Raises ``ValueError`` (vLLM's message) when the pool cannot hold one request of
    ``max_model_len`` tokens in every group.
    """
    cache = config.cache_config
    cache.num_gpu_blocks_override = cfg.num_blocks
    if cache.kv_cache_layout is None:
        cache.kv_cache_layout = KV_CACHE_LAYOUT
    kv = plan_kv_cache(config, layer_specs(cfg, config))
    if kv.num_blocks != cfg.num_blocks:
        raise ValueError(f"vLLM planned {kv.num_blocks} blocks, not {cfg.num_blocks}")
    return kv
