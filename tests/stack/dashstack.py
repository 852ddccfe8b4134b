"""Prometheus (with kvscope's rules), ``kvscope serve`` and the dashboard feeder
(tests/stack/dashfeed.py) on free ports, for tests/stack/test_dashboards.py.

Built from promstack's helpers; every process binds 127.0.0.1 and is stopped by its PID.
The sidecar keeps its default sinks: the decision log and the embedded chDB store, which
the ClickHouse panels are run against once the sidecar has stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvscope.localvllm.server import free_port
from tests.stack.promstack import (
    FEED_SERVER,
    HEALTH_TIMEOUT_S,
    REPO,
    RULE_FILE,
    Proc,
    Prometheus,
    binary,
    ready,
    wait_for,
)


class DashStack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ports = {"prom": free_port(), "sidecar": free_port()}
        self.endpoint = f"ipc://{tmp}/probe.sock"
        self.prom = Prometheus(f"http://127.0.0.1:{self.ports['prom']}")
        self.data = tmp / "data"
        self.decision_log = tmp / "decisions.jsonl"
        self.procs: dict[str, Proc] = {}

    def write_config(self) -> Path:
        """Scrape the sidecar every second, with the committed rules (the dashboards read
        their recording rules); checked by promtool."""
        cfg = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(RULE_FILE)],
            "scrape_configs": [{"job_name": "kvscope", "static_configs": [
                {"targets": [f"127.0.0.1:{self.ports['sidecar']}"]}]}],
        }
        path = self.tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        done = subprocess.run([binary("promtool"), "check", "config", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return path

    def start(self) -> None:
        prom_cfg = self.write_config()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}
        # The twin is no API server: name its server as a deployment would.
        self._start("feeder", [sys.executable, "-m", "tests.stack.dashfeed", "feed",
                               self.endpoint], cwd=REPO, stdin=subprocess.PIPE,
                    env={**env, "KVSCOPE_SERVER": FEED_SERVER})
        self._start("sidecar", [
            sys.executable, "-m", "kvscope", "serve", "--endpoint", self.endpoint,
            "--port", str(self.ports["sidecar"]), "--health-timeout", str(HEALTH_TIMEOUT_S),
            "--log-level", "warning", "--data-dir", str(self.data),
            "--decision-log", str(self.decision_log), "--layout-interval", "0.5",
        ], env=env)
        self._start("prometheus", [
            binary("prometheus"), f"--config.file={prom_cfg}",
            f"--storage.tsdb.path={self.tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.ports['prom']}",
        ])
        self.wait("Prometheus ready", lambda: ready(self.prom.base), 30)
        self.wait("Prometheus scraping the sidecar",
                  lambda: self.prom.query('up{job="kvscope"} == 1'), 90)
        self.wait("the feeder to import vLLM", lambda: self.feeder_line("READY"), 120)

    def _start(self, name: str, cmd: list[str], **kw: Any) -> None:
        self.procs[name] = Proc(name, cmd, self.tmp / f"{name}.log", **kw)

    def feeder_line(self, word: str) -> str | None:
        feeder = self.procs["feeder"]
        for line in feeder.log.read_text(errors="replace").splitlines():
            if line.startswith(word):
                return line
        if not feeder.alive():
            raise AssertionError(f"the feeder exited before {word}\n{feeder.tail()}")
        return None

    def go(self) -> None:
        stdin = self.procs["feeder"].popen.stdin
        assert stdin is not None
        stdin.write(b"go\n")
        stdin.flush()

    def done(self) -> dict[str, Any] | None:
        line = self.feeder_line("DONE")
        return json.loads(line[5:]) if line else None

    def wait(self, what: str, check: Any, timeout_s: float, every_s: float = 0.2,
             report: Any = None) -> None:
        """wait_for, failing at once (with logs) when a server died meanwhile."""

        def step() -> Any:
            for name, p in self.procs.items():
                if name != "feeder" and not p.alive():
                    raise AssertionError(f"{name} exited while waiting for {what}")
            return check()

        try:
            wait_for(what, step, timeout_s, every_s)
        except AssertionError as exc:
            tails = "\n".join(p.tail(15) for p in self.procs.values())
            raise AssertionError(f"{exc}\n{report() if report else ''}\n{tails}") from None

    def label_values(self, selector: str, label: str) -> list[str]:
        r = httpx.get(f"{self.prom.base}/api/v1/label/{label}/values",
                      params={"match[]": selector}, timeout=5.0)
        body = r.json()
        assert body.get("status") == "success", body
        return sorted(body["data"])

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()


class ChWorker:
    """tests/stack/chworker.py on a chDB store, asked one query at a time."""

    def __init__(self, dsn: str, database: str, log: Path) -> None:
        self._log = open(log, "wb")  # closed in close()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.stack.chworker", dsn, database], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        first = self._read()
        assert first.get("ready"), first

    def _read(self) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line:
            raise AssertionError("the chDB worker exited; see its log")
        return dict(json.loads(line))

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(req) + "\n")
        self.popen.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()
