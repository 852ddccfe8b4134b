"""Real Prometheus, Alertmanager, kvscope sidecar and twin processes for the stack tests.

Every process is started on 127.0.0.1 with its output in a log file, waited for with a
deadline (polling, never a fixed sleep) and stopped by its PID. ``python -m
tests.stack.promstack feed ENDPOINT`` is the twin feeder the live test runs as a child.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from kvscope.procs import stop_process
from kvscope.twin import TwinConfig, WorkloadSpec, generate

REPO = Path(__file__).resolve().parents[2]
RULE_FILE = REPO / "alerts" / "kvscope.rules.yml"
APT_LINE = (
    "apt-get update && apt-get install -y --no-install-recommends "
    "prometheus prometheus-alertmanager"
)


def binary(name: str) -> str:
    """Path of a Debian prometheus / prometheus-alertmanager binary, or a failure that
    says how to install it (the stack tests are never skipped)."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} is not installed; run: {APT_LINE}")
    return path


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except (httpx.HTTPError, OSError, ValueError) as exc:
            last_error = exc
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}"
                         + (f" (last error: {last_error!r})" if last_error else ""))


class Proc:
    """A child process with its output in ``log``, stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], log: Path, **kw: Any) -> None:
        self.name = name
        self.log = log
        self._out: IO[bytes] = open(log, "wb")  # closed in stop()
        self.popen = subprocess.Popen(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True, **kw
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last lines of {self.name} ({self.log}) ---\n" + "\n".join(text)

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.popen, timeout_s)
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        self._out.close()


def ready(base: str) -> bool:
    return httpx.get(f"{base}/-/ready", timeout=2.0).status_code == 200


class Prometheus:
    """Queries of a running Prometheus server."""

    def __init__(self, base: str) -> None:
        self.base = base

    def _result(self, api: str, expr: str, **params: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.base}/api/v1/{api}", params={"query": expr, **params},
                      timeout=5.0)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"query failed: {expr!r}: {body}")
        return list(body["data"]["result"])

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self._result("query", expr)

    def query_range(self, expr: str, start: float, end: float,
                    step_s: float) -> list[dict[str, Any]]:
        """``expr`` evaluated every ``step_s`` from ``start`` to ``end`` (Unix seconds)."""
        return self._result("query_range", expr, start=f"{start:.3f}", end=f"{end:.3f}",
                            step=str(step_s))

    def first_sample(self, expr: str, since: float,
                     step_s: float = 0.5) -> tuple[float, str, dict[str, str]] | None:
        """The earliest (Unix time, value, labels) at which ``expr`` returned data since
        ``since``, evaluated every ``step_s`` (half the stacks' 1 s scrape interval, so no
        scrape is skipped); None when it never did. Unlike an instant query at poll time it
        finds a condition that held for one scrape however late the poll comes."""
        series = self.query_range(expr, since, time.time(), step_s)
        firsts = [(float(ts), value, s["metric"]) for s in series for ts, value in s["values"][:1]]
        return min(firsts, key=lambda f: f[0]) if firsts else None

    def rules(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.base}/api/v1/rules", timeout=5.0)
        return [rule for g in r.json()["data"]["groups"] for rule in g["rules"]]


class Webhook:
    """An Alertmanager webhook receiver: a tiny HTTP server keeping every POSTed payload."""

    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        payloads = self.payloads

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                payloads.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def alerts(self) -> list[dict[str, Any]]:
        return [a for p in list(self.payloads) for a in p.get("alerts", [])]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def send_foreign_frame(endpoint: str) -> None:
    """Push one frame of another wire version, as a probe of another kvscope release would."""
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoint)
        sock.send_multipart([b"kvscope/0", b"\x80"])
        sock.close()
    finally:
        ctx.term()


# -- rules ------------------------------------------------------------------------------
def load_rules(path: Path = RULE_FILE) -> list[dict[str, Any]]:
    return [rule for g in yaml.safe_load(path.read_text())["groups"] for rule in g["rules"]]


def rule_key(rule: dict[str, Any]) -> str:
    """``record`` name, or ``alert`` name with its severity (one alert has two rules)."""
    if "record" in rule:
        return rule["record"]
    return f"{rule['alert']}[{rule['labels']['severity']}]"


_SELECTOR = re.compile(
    r"\b((?:vllm_scheduler_|kvscope_)\w+|[a-z_]+:\w+:\w+|up)(\{[^}]*\})?(?!\w|\s*\()"
)


def selectors(expr: str) -> list[str]:
    """The series selectors an expression reads (range brackets dropped), in order."""
    seen: list[str] = []
    for name, matchers in _SELECTOR.findall(expr):
        sel = name + matchers
        if sel not in seen:
            seen.append(sel)
    return seen


# -- the twin feeder (runs as a child process) -------------------------------------------
BURST = WorkloadSpec(n_requests=80, seed=1, short_fraction=1.0, short_prompt=(120, 250),
                     max_tokens=(1, 1), waves=1)
"""Prompt-only requests arriving at once: every step fills most of the 512-token budget."""
BURST_STEP_S = 0.1
PRESSURE = WorkloadSpec(n_requests=200, seed=0, short_fraction=0.85, max_tokens=(64, 384))
"""Mostly short prompts with long outputs on 48 blocks: the pool stays near empty."""
PRESSURE_STEP_S = 0.006
PRESSURE_MAX_STEPS = 3000
HEALTH_TIMEOUT_S = 5
"""The stacks' kvscope serve --health-timeout (the least the sidecar accepts: twice the
probe's heartbeat interval)."""
PHASE_S = 12.0
"""How long the feeder stays stalled, then silent: longer than the health timeout."""
FEED_SERVER = "twin-feed:8000"
"""The feeding twin's server label (KVSCOPE_SERVER): the twin is no API server."""


def feed(endpoint: str) -> None:
    """vLLM's real scheduler with the probe streaming to ``endpoint``, in two phases:

    1. BURST, a prefill burst: the token budget is busy, which the field's contiguity rule
       needs (the budget gauge covers the last 10 s of steps);
    2. PRESSURE, decode-heavy on 48 blocks: the pool runs out while the budget idles,
       requests are preempted and admission blocks. It stops after PRESSURE_MAX_STEPS with
       requests still running or waiting: an engine that stalls with work pending;
    3. STALLED: no more steps while the probe heartbeats (the engine loop is stuck), then
       SILENT: the probe stops while the process lives; then the process exits (gone).
       Each lasts ``PHASE_S``, longer than the sidecar's health timeout.

    Prints READY after the (slow) vLLM imports, waits for a line on stdin, prints
    ``DONE {json}`` at the end, and exits.
    """
    import dataclasses

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from kvscope.twin.engine import Twin
    from kvscope_probe import plugin

    if not plugin.enable(endpoint):
        raise SystemExit("the kvscope probe could not attach to this vLLM")
    twin = Twin(TwinConfig(num_blocks=48))
    burst = [dataclasses.replace(r, request_id=f"burst-{r.request_id}") for r in generate(BURST)]
    pressure = generate(PRESSURE)
    print("READY", flush=True)
    sys.stdin.readline()
    b = twin.run(burst, step_interval_s=BURST_STEP_S)
    p = twin.run(pressure, step_interval_s=PRESSURE_STEP_S, max_steps=PRESSURE_MAX_STEPS)
    sched = twin.scheduler
    done = {
        "steps": b.steps + p.steps,
        "preemptions": b.preemptions + p.preemptions,
        "seconds": round(b.wall_seconds + p.wall_seconds, 1),
        "running": len(sched.running),
        "waiting": len(sched.waiting),
    }
    time.sleep(PHASE_S)  # stalled: heartbeats, no step, work pending
    plugin.stop_all()
    time.sleep(PHASE_S)  # silent: the probe stopped, the process lives
    print("DONE " + json.dumps(done), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "feed":
        feed(sys.argv[2])
    else:
        raise SystemExit("usage: python -m tests.stack.promstack feed ENDPOINT")
