"""Helpers shared by the benchmarks: percentiles, a ``kvscope serve`` subprocess, the
machine-wide vLLM lock, and reading the sidecar's HTTP API.

Nothing here imports vLLM, so an orchestrating process stays light.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscope.localvllm.server import HOST, free_port
from kvscope.procs import stop_process

VLLM_LOCK_PATH = Path("/tmp/kvscope-vllm.lock")
"""Held for the whole life of every vLLM server, by these benchmarks and the engine tests."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1) of unsorted ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(math.ceil(q * len(ordered)) - 1, 0))])


def median(values: Sequence[float]) -> float:
    return percentile(values, 0.5)


def machine_noise() -> dict[str, Any]:
    """Load average and vLLM processes alive now: context for reading the figures."""
    others = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "vllm.entrypoints" in text or "EngineCore" in text:
            others.append(int(cmdline.parent.name))
    return {"loadavg_1m": os.getloadavg()[0], "vllm_pids": sorted(others)}


def write_summary(summary: dict[str, Any], out: Path) -> None:
    """Close a benchmark's run: the machine's noise after it, ``summary.json`` in ``out``,
    and the same JSON as the last line printed."""
    summary["noise_after"] = machine_noise()
    line = json.dumps(summary)
    (out / "summary.json").write_text(line)
    print(line)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def git_state(checkout: Path | None = None) -> dict[str, Any]:
    """The commit measured (of ``checkout``, default this one), and which probe sources
    (the code whose cost is measured) differ from it; other changed paths under
    exporter/ are only counted."""
    root = checkout or Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("status", "--porcelain", "--", "exporter").splitlines()
    probe = [c for c in changed if "kvscope_probe/" in c]
    return {"commit": git("rev-parse", "--short", "HEAD"), "probe_changed": probe,
            "other_changed": len(changed) - len(probe)}


def noise_line(samples: Sequence[dict[str, Any]]) -> str:
    """One line summing up ``machine_noise()`` samples taken before each run."""
    loads = [s["loadavg_1m"] for s in samples]
    others = sum(1 for s in samples if s["vllm_pids"])
    return (f"machine: {os.cpu_count()} cores, 1-min load average {min(loads):.1f}-"
            f"{max(loads):.1f} before the runs; other vLLM processes alive before "
            f"{others} of {len(samples)} runs")


@contextlib.contextmanager
def vllm_lock(wait_s: float = 3600.0) -> Iterator[float]:
    """Hold the exclusive machine lock that lets one vLLM server run at a time.

    Yields the seconds spent waiting for it.
    """
    with VLLM_LOCK_PATH.open("a") as f:
        started = time.monotonic()
        said = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:
                    print(f"  waiting for {VLLM_LOCK_PATH} ...", file=sys.stderr, flush=True)
                    said = True
                if time.monotonic() - started > wait_s:
                    raise TimeoutError(f"{VLLM_LOCK_PATH} busy for {wait_s:.0f} s") from None
                time.sleep(0.5)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Sidecar:
    """``kvscope serve`` as a subprocess in its own process group, on a free port."""

    def __init__(self, endpoint: str, log_path: Path, extra: Sequence[str] = (),
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.endpoint = endpoint
        self.env = dict(env or {})
        """Environment set for the sidecar only (PYTHONPATH of a baseline checkout)."""
        self.prefix = list(prefix)
        """A command the sidecar runs under (valgrind)."""
        self.extra = list(extra)
        """More ``kvscope serve`` flags (store, decision log, data dir)."""
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 30.0) -> None:
        argv = [*self.prefix, sys.executable, "-m", "kvscope", "serve", "--endpoint", self.endpoint,
                "--port", str(self.port), "--log-level", "warning", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
        env.update(self.env)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvscope serve exited with {self.proc.returncode}; "
                                   f"see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/api/engines", timeout=2.0,
                             trust_env=False).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"kvscope serve not answering after {ready_timeout_s:.0f} s")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "sidecar not started"
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """User + system CPU time the sidecar has used so far."""
        return process_cpu_s(self.pid)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the group, SIGKILL it after ``timeout_s``; reap. Idempotent."""
        if self.proc is not None:
            stop_process(self.proc, timeout_s, group=True)


SINK_CODE = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.PULL)
sock.bind(sys.argv[1])
while True:
    sock.recv_multipart(copy=False)
"""


class Sink:
    """A process that receives the probe's frames and discards them: the probe's whole
    work in the engine process, without a sidecar's work on the machine's other core."""

    url = ""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SINK_CODE, self.endpoint],
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "sink not started"
        return self.proc.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None:
            stop_process(self.proc, timeout_s, group=True)


def sidecar_engine(url: str, engine: str) -> dict[str, Any] | None:
    """The sidecar's ``/api/engines`` entry for ``engine``, or None."""
    body = httpx.get(f"{url}/api/engines", timeout=10.0, trust_env=False).json()
    return next((e for e in body["engines"] if e["engine"] == engine), None)


def wait_engine_steps(url: str, engine: str, steps: int | None,
                      timeout_s: float = 60.0) -> dict[str, Any] | None:
    """Poll until the sidecar has ``steps`` steps of ``engine`` (None: until the count
    stops moving); return its summary, or the last one seen at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        seen = sidecar_engine(url, engine)
        if seen is not None:
            if steps is not None and seen["steps"] >= steps:
                return seen
            if steps is None and last is not None and seen["steps"] == last["steps"]:
                return seen
        last = seen
        time.sleep(0.5)
    return last


def scrape(url: str, by: str = "") -> dict[tuple[str, ...], float]:
    """A Prometheus exposition as ``{(sample name, engine label or ""): value}``; samples
    that differ in other labels (``thread``, ``reason``, ...) are summed. ``by``: one more
    label kept apart, ``{(name, engine, that label or ""): value}``."""
    text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    out: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, s.labels.get("engine", ""))
            if by:
                key += (s.labels.get(by, ""),)
            out[key] = out.get(key, 0.0) + s.value
    return out


def fmt_us(ns: float) -> str:
    return f"{ns / 1000:.1f}"
