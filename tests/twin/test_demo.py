"""`kvscope demo` end to end, as a user runs it: live metrics, a summary, a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.localvllm.server import free_port

pytestmark = pytest.mark.twin


def test_demo_serves_live_metrics_and_stops_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "demo", "--port", str(port), "--step-ms", "1",
         "--requests", "80", "--blocks", "48"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "demo exited early:\n" + "".join(lines)
            lines.append(line)
            if "(Ctrl-C to stop)" in line:
                break
        text = "".join(lines)
        assert f"http://127.0.0.1:{port}/metrics" in text
        assert "what kvscope measured" in text
        preempt_line = next(ln for ln in lines if ln.strip().startswith("preemptions"))
        shown = int(preempt_line.split()[1])
        assert shown > 0

        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        samples = {(s.name, s.labels.get("reason")): s.value
                   for f in text_string_to_metric_families(metrics) for s in f.samples}
        total = sum(v for (n, _), v in samples.items()
                    if n == "vllm_scheduler_preempted_requests_total")
        assert total == shown
        assert samples[("kvscope_ledger_synced", None)] == 1
        assert samples[("vllm_scheduler_total_blocks", None)] == 47
        assert ("vllm_scheduler_max_contiguous_free_blocks", None) in samples
        sidecar_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert sidecar_pids
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    for pid in sidecar_pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
