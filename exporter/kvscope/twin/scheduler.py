"""Build vLLM's real V1 ``Scheduler`` and ``KVCacheManager`` with no model behind them.

This follows what ``EngineCore.__init__`` does once the workers have reported their
KV-cache layout: the same config objects, the same scheduler constructor, the same
block hasher. Only the model is missing; ``kvscope.twin.engine`` plays its part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvscope.models.config import (
    MAX_POSITION_EMBEDDINGS,
    default_cache_dir,
    write_llama_config,
)
from kvscope.models.kv_layout import KvModel
from kvscope.twin._vllm import (
    AsyncScheduler,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    Request,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputManager,
    VllmConfig,
    get_hash_fn_by_name,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from kvscope.twin.config import TwinConfig
from kvscope.twin.kv_layout import group_kind, kv_cache_config

MODEL_CONFIG_DIR = "tiny-llama-config"
"""Directory under the cache dir holding only the tiny Llama's config.json."""


TWIN_MODEL_NAME = "twin"
"""The model label the twin's engine reports (its config is a stand-in Llama)."""

SPECULATIVE_METHOD = "draft_model"
"""A draft-model speculator: vLLM reserves ``num_speculative_tokens`` lookahead slots
for it (``VllmConfig.num_lookahead_tokens``). The draft model is the tiny Llama's config
again; nothing is loaded."""


def vllm_config(cfg: TwinConfig, model_dir: Path | None = None) -> VllmConfig:
    """The ``VllmConfig`` a server started with ``cfg``'s flags would build."""
    positions = cfg.max_position_embeddings
    default_dir = default_cache_dir() / (MODEL_CONFIG_DIR if positions == MAX_POSITION_EMBEDDINGS
                                         else f"{MODEL_CONFIG_DIR}-{positions}")
    model_dir = write_llama_config(model_dir or default_dir,
                                   max_position_embeddings=positions)
    model = ModelConfig(
        model=str(model_dir),
        served_model_name=TWIN_MODEL_NAME,
        dtype="float32",
        max_model_len=cfg.max_model_len,
        skip_tokenizer_init=True,
        seed=0,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_scheduled_tokens=cfg.max_num_scheduled_tokens,
        max_model_len=cfg.max_model_len,
        policy=cfg.policy,
        enable_chunked_prefill=True,
        async_scheduling=cfg.async_scheduling,
        is_encoder_decoder=False,
        watermark=cfg.watermark,
    )
    cache = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
    dcp = cfg.decode_context_parallel_size
    parallel = (ParallelConfig() if dcp == 1 else
                ParallelConfig(tensor_parallel_size=2 * dcp, decode_context_parallel_size=dcp))
    speculative = None
    if cfg.num_speculative_tokens:
        speculative = SpeculativeConfig(
            method=SPECULATIVE_METHOD,
            model=str(model_dir),
            num_speculative_tokens=cfg.num_speculative_tokens,
            target_model_config=model,
            target_parallel_config=parallel,
        )
    config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache,
                        parallel_config=parallel, speculative_config=speculative)
    # This process runs on vLLM's CPU platform, which turns async scheduling off
    # (platforms/cpu.py check_and_update_config); a GPU server keeps it, and with it two
    # batches in flight (VllmConfig.max_concurrent_batches), which the sliding-window
    # admission cap counts.
    config.scheduler_config.async_scheduling = cfg.async_scheduling
    # The engine sets this after profiling; --num-gpu-blocks-override pins it.
    config.cache_config.num_gpu_blocks = cfg.num_blocks
    return config


def build_scheduler(
    cfg: TwinConfig,
    scheduler_cls: type[Scheduler] | None = None,
    *,
    model_dir: Path | None = None,
) -> Scheduler:
    """vLLM's real ``Scheduler`` (``AsyncScheduler`` when ``cfg.async_scheduling``; or
    ``scheduler_cls``, a subclass) configured by ``cfg``.

    ``model_dir`` is where the config-only tiny Llama is written (default: the kvscope
    cache dir). Raises ``ValueError`` listing every problem when ``cfg`` is invalid.
    """
    errors = cfg.validate()
    if errors:
        raise ValueError("invalid TwinConfig: " + " ".join(errors))
    config = vllm_config(cfg, model_dir)
    try:
        kv_config = kv_cache_config(cfg, config)
    except ValueError as exc:  # vLLM's own check: a server would refuse to start
        raise ValueError(f"invalid TwinConfig: {exc}") from None
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    cls = scheduler_cls or (AsyncScheduler if cfg.async_scheduling else Scheduler)
    return cls(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=True,  # a server's default: keeps per-request events and prefix-cache stats
    )


def planned_groups(cfg: TwinConfig, layers: tuple[str, ...]) -> tuple[str, ...]:
    """The KV cache groups vLLM's planner makes of a model whose layers are ``layers``
    (one kind each, in layer order), one kind per group: one layer of each kind per group,
    the groups as many as the pattern needs (a Gemma 3 12B of 40 sliding-window and 8
    full layers: 5 + 1; 1:1 interleaved layers: 1 + 1). The pool only has to pass vLLM's
    start-up check; the grouping does not depend on its size."""
    whole = replace(cfg, groups=layers,
                    num_blocks=len(layers) * -(-cfg.max_model_len // cfg.block_size) + 1)
    kv = kv_cache_config(whole, vllm_config(whole))
    return tuple(group_kind(g.kv_cache_spec) for g in kv.kv_cache_groups)


def model_fields(model: KvModel) -> dict[str, Any]:
    """The TwinConfig fields of a served model: ``KvModel.twin_fields`` and, for a model
    whose layers mix kinds, the KV cache groups vLLM makes of them (``planned_groups``,
    which no other setting changes)."""
    fields = model.twin_fields()
    if len(set(model.layer_kinds)) > 1:
        base = replace(TwinConfig(), **fields,
                       max_model_len=min(TwinConfig.max_model_len, model.max_position_embeddings))
        fields["groups"] = planned_groups(base, model.layer_kinds)
    return fields


def request_block_hasher(scheduler: Scheduler) -> Callable[[Request], list[Any]] | None:
    """The prefix-cache block hasher ``EngineCore`` gives every request, or None when off.

    Python's builtin ``hash`` is not accepted; the server's default is sha256.
    """
    cache_config = scheduler.vllm_config.cache_config
    if not cache_config.enable_prefix_caching:
        return None
    hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(scheduler.hash_block_size, hash_fn)
