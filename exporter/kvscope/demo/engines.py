"""The two engines ``kvscope demo`` can drive, behind one small interface.

- ``twin``: vLLM's real scheduler in this process (no model), with the probe attached and
  an OpenAI-compatible front carrying kvscope's middleware (:mod:`kvscope.demo.twin_server`).
- ``vllm``: a real vLLM OpenAI server on the CPU serving a tiny generated model, with the
  probe (``KVSCOPE_PROBE_ENDPOINT``) and the middleware (``--middleware``).

Both expose ``url`` and ``model`` for the clients, ``steps()`` (the scheduler steps taken,
when known here), ``failure()`` (why the engine stopped, if it did) and ``stop()``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

import psutil

from kvscope.localvllm.server import ServerSpec, VllmServer, free_port
from kvscope.models.config import default_cache_dir
from kvscope.models.tiny import make_tiny_model
from kvscope.twin import TwinConfig

MIDDLEWARE = "kvscope_probe.middleware.KVScopeMiddleware"


class DemoError(RuntimeError):
    """Something the demo cannot go on without; printed as one line."""


class Engine(Protocol):
    name: str
    url: str
    model: str

    def start(self) -> None: ...
    def steps(self) -> int | None: ...
    def failure(self) -> str | None: ...
    def stop(self) -> None: ...


class TwinEngine:
    name = "twin"

    def __init__(self, cfg: TwinConfig, seed: int, step_s: float, endpoint: str) -> None:
        self.cfg, self.seed, self.step_s, self.endpoint = cfg, seed, step_s, endpoint
        self.url = self.model = ""
        self._server: Any = None

    def start(self) -> None:
        if "VLLM_LOGGING_LEVEL" not in os.environ:
            # vLLM's start-up notes (no Triton on this CPU, ...) reach stderr through
            # Python's last-resort handler, past VLLM_LOGGING_LEVEL: quiet its logger.
            os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
            logging.getLogger("vllm").setLevel(logging.ERROR)
        from kvscope.demo.twin_server import TwinServer
        from kvscope.twin.engine import Twin
        from kvscope.twin.scheduler import TWIN_MODEL_NAME
        from kvscope_probe import plugin

        if not plugin.enable(self.endpoint):
            raise DemoError("the probe could not attach to this vLLM")
        try:
            twin = Twin(self.cfg, seed=self.seed)
        except ValueError as exc:  # vLLM's own check of the pool for this layout
            raise DemoError(str(exc)) from None
        self._server = TwinServer(twin, self.step_s, TWIN_MODEL_NAME, self.endpoint)
        self._server.start()
        self.url, self.model = self._server.url, TWIN_MODEL_NAME

    def steps(self) -> int | None:
        return None if self._server is None else self._server.loop.steps

    def failure(self) -> str | None:
        err = None if self._server is None else self._server.loop.error
        return None if err is None else f"the twin stopped: {type(err).__name__}: {err}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            from kvscope_probe import plugin

            plugin.stop_all()


class VllmEngine:
    name = "vllm"

    def __init__(self, cfg: TwinConfig, endpoint: str, workdir: Path) -> None:
        self.model_dir = default_cache_dir() / "tiny-llama"
        self.spec = ServerSpec(
            self.model_dir, free_port(), block_size=cfg.block_size,
            num_gpu_blocks=cfg.num_blocks, max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            scheduling_policy=cfg.policy, extra_env={"KVSCOPE_PROBE_ENDPOINT": endpoint},
            extra_args=("--middleware", MIDDLEWARE))
        self.log_path = workdir / "vllm.log"
        self.server = VllmServer(self.spec, log_path=self.log_path)
        self.url, self.model = self.server.url, self.spec.served_model_name

    def start(self) -> None:
        make_tiny_model(self.model_dir)
        self.server.start()
        try:
            self.server.wait_ready(timeout_s=300.0)
        except (RuntimeError, TimeoutError) as exc:
            raise DemoError(str(exc)) from None

    def steps(self) -> int | None:
        return None  # the engine steps in its own process; the sidecar counts them

    def failure(self) -> str | None:
        try:
            alive = psutil.Process(self.server.pid).status() != psutil.STATUS_ZOMBIE
        except (RuntimeError, psutil.NoSuchProcess):  # not started, or gone
            alive = False
        return None if alive else f"vLLM is not running; log {self.log_path}"

    def stop(self) -> None:
        self.server.stop()
