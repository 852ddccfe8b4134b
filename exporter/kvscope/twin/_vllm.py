"""The twin's one door into vLLM: every vLLM name it uses, imported in one place.

Importing this module imports vLLM (slow the first time); nothing outside
``kvscope.twin`` imports it, so ``import kvscope`` stays light. vLLM's own logging
is turned down to warnings unless ``VLLM_LOGGING_LEVEL`` says otherwise; that has
to happen before vLLM is first imported, hence the order below.

vLLM 0.32 and 0.33 differ in one place the twin touches: 0.33 moved the KV-cache
planner to ``v1/core/kv_cache_planning.py`` and split layer grouping
(``get_global_kv_cache_groups``) from sizing (``get_kv_cache_configs``, called that way
by ``v1/engine/core.py``); 0.32 does both in ``v1/core/kv_cache_utils.py``.
``plan_kv_cache`` calls whichever this vLLM has, as its ``EngineCore`` does.
"""

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.model_executor.models.config import MambaModelConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import (  # noqa: E402
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # noqa: E402

    get_global_kv_cache_groups = None

PLANNER_MEMORY_BYTES = 1 << 40
"""Memory offered to the planner; ``num_gpu_blocks_override`` decides the pool size."""


def plan_kv_cache(config: VllmConfig, specs: dict[str, KVCacheSpec]) -> KVCacheConfig:
    """The scheduler's ``KVCacheConfig`` for one worker's layer specs, planned the way
    ``EngineCore._initialize_kv_caches`` plans it."""
    workers = [specs]
    memory = [PLANNER_MEMORY_BYTES]
    if get_global_kv_cache_groups is None:
        configs = get_kv_cache_configs(config, workers, memory)
    else:
        groups = get_global_kv_cache_groups(config, workers)
        configs = get_kv_cache_configs(config, workers, memory, groups)
    return generate_scheduler_kv_cache_config(configs)


__all__ = [
    "AsyncScheduler",
    "CacheConfig",
    "DraftTokenIds",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "MambaModelConfig",
    "MambaSpec",
    "ModelConfig",
    "ModelRunnerOutput",
    "ParallelConfig",
    "Request",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "SpeculativeConfig",
    "StructuredOutputManager",
    "VllmConfig",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "init_none_hash",
    "plan_kv_cache",
    "resolve_kv_cache_block_sizes",
    "torch",
]
