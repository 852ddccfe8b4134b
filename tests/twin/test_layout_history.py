"""Layout snapshots reach ClickHouse and come back through /api/layout/history."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from kvscope.localvllm.server import free_port
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin
from tests.unit.test_layout_api import SCHEMA

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin


def test_history_older_than_memory_is_read_from_clickhouse(tmp_path: Path) -> None:
    port = free_port()
    endpoint = f"ipc://{tmp_path}/p.sock"
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "serve", "--endpoint", endpoint, "--port", str(port),
         "--data-dir", str(tmp_path / "data"), "--layout-interval", "0.2",
         "--decision-log", "off", "--log-level", "warning"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{base}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, "sidecar exited"
                time.sleep(0.2)
        assert plugin.enable(endpoint)
        twin = Twin(TwinConfig(num_blocks=48), seed=2)
        t_start = time.time()
        twin.run(generate(WorkloadSpec(n_requests=40, seed=2)), step_interval_s=0.002)
        plugin.stop_all()
        time.sleep(2.5)  # the last samples (the read from ClickHouse delivers them first)
        mem = httpx.get(f"{base}/api/layout/history", params={"since": t_start},
                        timeout=10).json()
        assert mem["source"] == "memory" and len(mem["snapshots"]) >= 3
        old = httpx.get(f"{base}/api/layout/history", params={"since": t_start - 3600},
                        timeout=10).json()
        assert old["source"] == "clickhouse"
        assert len(old["snapshots"]) >= 3
        assert old["snapshots"][0]["step"] == mem["snapshots"][0]["step"]  # same first sample
        # both answers are what the schema says, the one read from ClickHouse included
        # (it stores no owner's tokens or shared blocks, nor the step's time)
        for answer in (mem, old):
            jsonschema.validate(answer, {**SCHEMA, "$ref": "#/$defs/history_response"})
        assert {o["tokens"] for s in old["snapshots"] for o in s["owners"]} == {-1}
        first = old["snapshots"][-1]
        assert first["num_blocks"] == 48
        assert sum(run[3] for run in first["runs"]) == 48  # runs cover every block
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(30)
