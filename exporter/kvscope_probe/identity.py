"""Who an engine is: which vLLM server, which data-parallel rank, which process.

Every EngineCore process gets a distinct, stable identity by default, with no setting:
- ``server``: ``KVSCOPE_SERVER`` when set, else the ``host:port`` of the vLLM API server
  that started this engine, read from ``sys.argv``. The EngineCore inherits the API
  server's argv: with ``fork`` as process memory, with ``spawn`` (the CPU platform's
  method) because ``multiprocessing`` restores the parent's ``sys.argv`` in the child.
  A server bound to every interface (no ``--host``, or 0.0.0.0 / ::) is named by this
  machine's host name. A process that is no API server (offline ``LLM``, the twin) has no
  server (``""``) unless one is set.
- ``engine``: ``KVSCOPE_ENGINE`` when set, else the data-parallel index, as vLLM's own
  ``engine`` metric label has it. ``parallel_config.data_parallel_index`` keeps the real
  rank; ``data_parallel_rank`` is 0 in every rank of a dense model (vLLM resets it in
  ``reconfigure_for_independent_dp_rank``).
- ``started``: this process's start time (epoch seconds, 0.0 unknown), so the sidecar can
  tell whether the PID it sees is this very process (same host and PID namespace) before it
  judges the process dead by its PID.

``hello(sched)`` is what a probe says first: this identity, a fresh session, and the
scheduler's settings and KV layout the sidecar needs to read every record after it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvscope_probe import wire

ENV_SERVER = "KVSCOPE_SERVER"
ENV_ENGINE = "KVSCOPE_ENGINE"
MAX_LABEL = 64
"""Identity values longer than this are cut: they become Prometheus label values."""
DEFAULT_PORT = 8000
"""vLLM's API server port when ``--port`` is not given."""
_ALL_INTERFACES = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Identity:
    server: str
    engine: str
    dp_rank: int
    """The data-parallel index vLLM gave this engine (-1 unknown)."""
    started: float


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in argv (the last one wins, as argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def is_api_server(argv: list[str]) -> bool:
    """Whether argv starts vLLM's OpenAI API server (``vllm serve`` or the module)."""
    if not argv:
        return False
    prog = argv[0].replace("\\", "/")
    if prog.endswith("vllm/entrypoints/openai/api_server.py"):
        return True
    return prog.rsplit("/", 1)[-1] == "vllm" and len(argv) > 1 and argv[1] == "serve"


def api_server_address(argv: list[str], hostname: str | None = None) -> str:
    """``host:port`` (or the unix socket path) of the API server argv starts; "" if none."""
    if not is_api_server(argv):
        return ""
    uds = _flag(argv, "--uds")
    if uds:
        return uds
    host = _flag(argv, "--host") or ""
    if host in _ALL_INTERFACES:
        host = hostname if hostname is not None else socket.gethostname()
    port = _flag(argv, "--port") or str(DEFAULT_PORT)
    return f"{host}:{port}"


def data_parallel_index(parallel_config: Any) -> int:
    """The real DP rank: ``data_parallel_index`` where vLLM has it, else the rank."""
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel_config, name, None)
        if isinstance(value, int):
            return value
    return -1


def process_start_time(pid: int | str = "self") -> float:
    """Epoch seconds at which the process started (Linux /proc); 0.0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        # Field 22 of stat (starttime, clock ticks after boot); index 19 after the command.
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


def engine_key(server: str, engine: str) -> str:
    """One engine's name in a sidecar: ``server/engine``, or ``engine`` with no server."""
    return f"{server}/{engine}" if server else engine


def _label(value: str) -> str:
    return value.strip()[:MAX_LABEL]


def engine_identity(vllm_config: Any, env: dict[str, str] | None = None,
                    argv: list[str] | None = None) -> Identity:
    """This engine process's identity (see the module docstring)."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    dp = data_parallel_index(getattr(vllm_config, "parallel_config", None))
    server = env.get(ENV_SERVER) or api_server_address(sys.argv if argv is None else argv)
    engine = env.get(ENV_ENGINE) or str(max(dp, 0))
    return Identity(server=_label(server), engine=_label(engine) or "0", dp_rank=dp,
                    started=process_start_time())


def allocation_block_size(group: Any, managers: Any, index: int) -> int:
    """Tokens per block vLLM allocates for KV cache group ``index``: its manager's
    ``block_size``, the spec's times the decode-context-parallel ranks a sharded spec is
    spread over (``SingleTypeKVCacheManager.__init__``); the spec's own where no manager
    says (a vLLM without them)."""
    if index < len(managers):
        size = getattr(managers[index], "block_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return int(group.kv_cache_spec.block_size)


def kv_managers(kv_cache_manager: Any) -> Any:
    """vLLM's per-group KV cache managers of a scheduler's ``kv_cache_manager``, in
    group order (none where its coordinator has none)."""
    return getattr(getattr(kv_cache_manager, "coordinator", None), "single_type_managers", ())


def hello(sched: Any, disabled: dict[str, str] | None = None) -> wire.Hello:
    """The Hello for vLLM scheduler ``sched``: a new session of this engine
    (``disabled``: the features the probe does not record, ``fingerprint``)."""
    import vllm

    cfg = sched.vllm_config
    pool = sched.kv_cache_manager.block_pool
    managers = kv_managers(sched.kv_cache_manager)
    groups = [
        wire.KVGroup(type(g.kv_cache_spec).__name__, allocation_block_size(g, managers, i),
                     int(getattr(g.kv_cache_spec, "sliding_window", None) or 0))
        for i, g in enumerate(sched.kv_cache_config.kv_cache_groups)
    ]
    served = cfg.model_config.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    ident = engine_identity(cfg)
    sc = sched.scheduler_config
    return wire.Hello(
        engine=ident.engine,
        session=uuid.uuid4().hex[:16],
        pid=os.getpid(),
        vllm_version=str(getattr(vllm, "__version__", "unknown")),
        model=str(served or cfg.model_config.model),
        num_blocks=int(pool.num_gpu_blocks),
        block_size=int(sched.block_size),
        kv_groups=groups,
        token_budget=int(sched.max_num_scheduled_tokens),
        max_num_batched_tokens=int(sc.max_num_batched_tokens),
        max_num_seqs=int(sc.max_num_seqs),
        policy=str(sched.policy.value),
        prefix_caching=bool(pool.enable_caching),
        ts=time.time(),
        server=ident.server,
        dp_rank=ident.dp_rank,
        started=ident.started,
        disabled=dict(disabled or {}),
        max_model_len=int(getattr(sched, "max_model_len", 0) or 0),
        async_scheduling=any(c.__name__ == "AsyncScheduler" for c in type(sched).__mro__),
        spec_tokens=int(getattr(sched, "num_spec_tokens", 0) or 0),
        watermark_blocks=int(getattr(sched.kv_cache_manager, "watermark_blocks", 0) or 0),
    )
