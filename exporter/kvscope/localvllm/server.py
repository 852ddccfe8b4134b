"""Start and stop a real vLLM OpenAI server on the CPU, bound to 127.0.0.1.

Used by the engine tests, the benchmarks and ``kvscope demo --engine vllm``. The server
runs in its own process group so that stopping it also stops the EngineCore and worker
processes it forks.

vLLM on the CPU binds its worker's OpenMP threads to cores and reserves one more for the
EngineCore process (``vllm/utils/ompmultiprocessing.py``): on a small machine, work beside
it waits while it generates. ``ServerSpec.nice`` (default from ``KVSCOPE_VLLM_NICE``)
starts the server, and so every process it forks, at a lower CPU priority: the test suite
sets it so that the other test worker's timing (heartbeats against a health timeout) is not
starved while vLLM generates (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

import httpx

HOST = "127.0.0.1"
NICE_ENV = "KVSCOPE_VLLM_NICE"
"""The niceness (0-19) of the servers started without an explicit ``ServerSpec.nice``."""

# vLLM phones home and the HF libraries try the network unless told not to; this
# machine has no network for them anyway, so fail fast instead of retrying.
QUIET_ENV: dict[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class ServerSpec:
    """What to serve and how big the KV-cache block pool is."""

    model_dir: Path
    """A local model directory (no download is possible)."""
    port: int
    served_model_name: str = "tiny"
    block_size: int = 32
    """Tokens per KV block; the CPU attention backend needs a multiple of 32."""
    num_gpu_blocks: int = 48
    """Passed as ``--num-gpu-blocks-override``: the pool size, null block included."""
    kv_cache_memory_bytes: int = 64 * 1024 * 1024
    max_model_len: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    scheduling_policy: SchedulingPolicy = "fcfs"
    extra_env: dict[str, str] = field(default_factory=dict, hash=False)
    """Added to the server's environment after the quiet defaults."""
    extra_args: tuple[str, ...] = ()
    """Appended to the command line as given."""
    python: str = sys.executable
    """The interpreter (and so the environment) vLLM runs in."""
    nice: int = field(default_factory=lambda: default_nice())
    """The server's niceness (0: as this process; up to 19), inherited by its EngineCore and
    worker processes."""

    def __post_init__(self) -> None:
        errors = []
        if not 0 < self.port < 65536:
            errors.append(f"port must be in 1..65535, got {self.port}")
        if self.block_size <= 0 or self.block_size % 32:
            errors.append(f"block_size must be a positive multiple of 32, got {self.block_size}")
        for name in ("num_gpu_blocks", "kv_cache_memory_bytes", "max_model_len",
                     "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                errors.append(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.nice <= 19:
            errors.append(f"nice must be in 0..19, got {self.nice}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            errors.append(f"scheduling_policy must be fcfs or priority, "
                          f"got {self.scheduling_policy!r}")
        if errors:
            raise ValueError("invalid ServerSpec: " + "; ".join(errors))


def default_nice(env: dict[str, str] | None = None) -> int:
    """``KVSCOPE_VLLM_NICE`` as an int (0 when unset); a clear error for anything else."""
    raw = (os.environ if env is None else env).get(NICE_ENV, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"{NICE_ENV} must be an integer in 0..19, got {raw!r}") from None


def command(spec: ServerSpec) -> list[str]:
    """The server's argv. ``python -m`` because the ``vllm`` console script is broken;
    behind ``nice`` (which execs it: the PID stays the server's) when ``spec.nice``."""
    niced = ["nice", "-n", str(spec.nice)] if spec.nice else []
    return [
        *niced,
        spec.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(spec.model_dir),
        "--served-model-name", spec.served_model_name,
        "--host", HOST,
        "--port", str(spec.port),
        "--dtype", "float32",
        "--enforce-eager",
        "--block-size", str(spec.block_size),
        "--num-gpu-blocks-override", str(spec.num_gpu_blocks),
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--max-model-len", str(spec.max_model_len),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
        "--scheduling-policy", spec.scheduling_policy,
        *spec.extra_args,
    ]


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and never handed out before by
    this process: the kernel may give a port it gave a moment ago again once its socket is
    closed (148 repeats in 2,000 calls here), and a test that asks for two ports before
    binding either (a probe endpoint and an HTTP port) was once given the same one twice."""
    for _ in range(10_000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port left that this process has not handed out "
                       f"({len(_HANDED_OUT)} handed out)")


class ServerExited(RuntimeError):
    """The server process exited before it became ready."""


class VllmServer:
    """A vLLM API server process; ``with VllmServer(spec) as s:`` starts it and waits."""

    def __init__(self, spec: ServerSpec, log_path: Path | None = None,
                 ready_timeout_s: float = 240.0) -> None:
        self.spec = spec
        self.url = f"http://{HOST}:{spec.port}"
        self.log_path = log_path or _temp_log_path(spec.port)
        self.ready_timeout_s = ready_timeout_s
        self.startup_s: float | None = None
        """Seconds from start() to the first successful readiness check."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._stopped = False
        self.rpc_dir: Path | None = None
        """Where vLLM puts its ipc sockets (``VLLM_RPC_BASE_PATH``), private to this
        server and removed by ``stop``; None when the environment names one already.
        vLLM's default is the temp directory itself, where each server left its sockets
        (uuid-named files, never removed)."""

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("server not started")
        return self._proc.pid

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("server already started")
        env = {**os.environ, **QUIET_ENV, **self.spec.extra_env}
        if "VLLM_RPC_BASE_PATH" not in env:
            self.rpc_dir = Path(tempfile.mkdtemp(prefix="kvscope-vllm-rpc-"))
            env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        try:
            with self.log_path.open("wb") as log:
                self._proc = subprocess.Popen(
                    command(self.spec), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )
        except BaseException:
            self._remove_rpc_dir()
            raise
        self._started_at = time.monotonic()

    def wait_ready(self, timeout_s: float = 240.0) -> float:
        """Poll /health and /v1/models until both answer; return the startup seconds."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("server not started")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise ServerExited(f"vLLM exited with code {proc.returncode} before "
                                       f"it was ready; log {self.log_path}:\n{self.log_tail()}")
                if self._answers(client):
                    self.startup_s = time.monotonic() - self._started_at
                    return self.startup_s
                time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready after {timeout_s:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def _answers(self, client: httpx.Client) -> bool:
        try:
            if client.get("/health").status_code != 200:
                return False
            models = client.get("/v1/models")
        except httpx.HTTPError:
            return False
        return models.status_code == 200 and self.spec.served_model_name in models.text

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``; reap.

        Returns the server's exit code (None if it was never started). Idempotent.
        """
        proc = self._proc
        if proc is None:
            return None
        if self._stopped:
            return proc.returncode
        self._stopped = True
        pgid = proc.pid  # start_new_session made the server its group's leader
        deadline = time.monotonic() + timeout_s
        if proc.poll() is None or live_group_pids(pgid):
            _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
        # The EngineCore and workers are in the same group and may outlive the server.
        while live_group_pids(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if live_group_pids(pgid):
            _signal_group(pgid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 5.0
            while live_group_pids(pgid) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
        self._remove_rpc_dir()
        return proc.returncode

    def _remove_rpc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def log_tail(self, max_lines: int = 40) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(log.tell() - 16384, 0))
                text = log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-max_lines:])

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready(self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _temp_log_path(port: int) -> Path:
    fd, name = tempfile.mkstemp(prefix=f"kvscope-vllm-{port}-", suffix=".log")
    os.close(fd)
    return Path(name)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def live_group_pids(pgid: int) -> list[int]:
    """PIDs of the non-zombie processes in a process group (Linux: read from /proc).

    Zombies are left out: an orphan waiting for init to reap it is already dead, and
    counting it would stall stop() until its deadline.
    """
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after the parenthesised command name: state, ppid, pgrp, ...
            state, _ppid, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids
