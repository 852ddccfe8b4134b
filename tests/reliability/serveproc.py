"""``kvscope serve`` as a child process, and what the reliability tests read from it.

The child gets no ``KVSCOPE_*`` variable from the environment the suite runs in; its data
directory, decision log, stdout and stderr live in the test's own directory. It is
stopped by its PID (SIGTERM, then SIGKILL), never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvscope.localvllm.server import free_port

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    env.update(extra)
    return env


def wait_until(what: str, check: Callable[[], Any], timeout_s: float,
               every_s: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


class ServeProcess:
    """One ``python -m kvscope serve`` child with its own data directory."""

    def __init__(self, workdir: Path, *, endpoint: str | None = None, port: int | None = None,
                 args: list[str] | None = None, token: str | None = None,
                 decision_log: bool = True, env: dict[str, str] | None = None,
                 data_dir: Path | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.endpoint = endpoint or f"ipc://{workdir}/probe.sock"
        self.port = port or free_port()
        self.token = token
        self.scheme = "http"
        self.data_dir = data_dir or workdir / "data"
        self.decision_log = workdir / "decisions.jsonl"
        self.argv = [sys.executable, "-m", "kvscope", "serve", "--endpoint", self.endpoint,
                     "--port", str(self.port), "--data-dir", str(self.data_dir),
                     "--decision-log", str(self.decision_log) if decision_log else "off",
                     *(args or [])]
        self.env = clean_env(**(env or {}))
        self.stdout_path = workdir / "serve.stdout"
        self.stderr_path = workdir / "serve.stderr"
        self.proc: subprocess.Popen[bytes] | None = None
        self.verify: Any = True

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, ready_timeout_s: float = 60.0) -> ServeProcess:
        with self.stdout_path.open("ab") as out, self.stderr_path.open("ab") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, env=self.env, cwd=ROOT,
                                         start_new_session=True)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvscope serve exited with {self.proc.returncode}:\n"
                                     f"{self.stderr()[-3000:]}")
            try:
                if self.get("/metrics", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"kvscope serve not ready after {ready_timeout_s:.0f} s:\n"
                             f"{self.stderr()[-3000:]}")

    # -- HTTP ---------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 10.0, **kw: Any) -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if self.token and "authorization" not in {k.lower() for k in headers}:
            headers["Authorization"] = f"Bearer {self.token}"
        with httpx.Client(timeout=timeout, trust_env=False, verify=self.verify) as c:
            return c.get(self.url + path, headers=headers, **kw)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        r = self.get("/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics().get((name, frozenset(labels.items())))

    def engines(self) -> list[dict[str, Any]]:
        r = self.get("/api/engines")
        r.raise_for_status()
        return list(r.json()["engines"])

    # -- the process --------------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        assert self.proc is not None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM; (exit code or None when it had to be killed, seconds until it exited)."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            self.kill()
        return code, time.monotonic() - t0

    def stop(self, timeout_s: float = 20.0) -> None:
        """Idempotent cleanup for a ``finally``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.terminate(timeout_s)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stdout(self) -> str:
        try:
            return self.stdout_path.read_text(errors="replace")
        except OSError:
            return ""
