"""The twin's one door into vLLM: every vLLM name it uses, imported in one place.

Importing this module imports vLLM (about 13 s the first time); nothing outside
``kvscope.twin`` imports it, so ``import kvscope`` stays light. vLLM's own logging
is turned down to warnings unless ``VLLM_LOGGING_LEVEL`` says otherwise; that has
to happen before vLLM is first imported, hence the order below.
"""

import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

__all__ = [
    "CacheConfig",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "ModelConfig",
    "ModelRunnerOutput",
    "Request",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StructuredOutputManager",
    "VllmConfig",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "init_none_hash",
    "resolve_kv_cache_block_sizes",
    "torch",
]
