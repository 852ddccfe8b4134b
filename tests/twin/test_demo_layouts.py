"""`kvscope demo` on a hybrid layout with async scheduling and a speculative lookahead.

The twin builds the layout vLLM would (three KV cache groups for ``full+sliding``); the
sidecar must show the groups, count every preemption and keep its ledger exact (checked
against a keyframe every 0.2 s).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvscope.demo.live import Scrape
from tests.twin.test_demo import Demo, assert_gone, assert_nothing_lost

pytestmark = pytest.mark.twin

REQUESTS = 60


@pytest.mark.once
def test_demo_on_a_hybrid_layout_with_async_scheduling(tmp_path: Path) -> None:
    demo = Demo(tmp_path, "--step-ms", "4", "--requests", str(REQUESTS), "--layout",
                "full+sliding", "--sliding-window", "64", "--async-scheduling",
                "--speculative-tokens", "2", "--duration", "600",
                env={"KVSCOPE_PROBE_KEYFRAME_S": "0.2"})  # keyframes check the ledger
    try:
        demo.wait_for(r"\(Ctrl-C to stop\)", 150)
        text = demo.text()
        assert ("layout       full+sliding (window 64 tokens), AsyncScheduler, "
                "2 draft tokens/step") in text
        assert f"{REQUESTS}/{REQUESTS} requests answered (0 failed)" in text
        shown = int(re.search(r"^  preemptions\s+(\d+) \(", text, re.M).group(1))  # type: ignore[union-attr]
        pids = demo.descendants()
        with httpx.Client(base_url=demo.base, timeout=10, trust_env=False) as http:
            m = Scrape(http.get("/metrics").text)
            engine = http.get("/api/layout").json()["engines"][0]
        assert [g["kind"] for g in engine["kv_groups"]] == [
            "SlidingWindowSpec", "SlidingWindowSpec", "FullAttentionSpec"]
        assert m.value("vllm_scheduler_total_blocks") == 127
        assert_nothing_lost(m)
        assert m.total("vllm_scheduler_preempted_requests_total") == shown
        assert m.total("vllm_scheduler_requests_ended_total") == REQUESTS
        assert m.total("kvscope_ledger_mismatches_total") == 0
        demo.proc.send_signal(signal.SIGINT)
        assert demo.finish() == 130, demo.text()
    finally:
        demo.kill()
    assert_gone(pids)


def test_a_real_server_demo_refuses_twin_only_layouts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvscope", "demo", "--engine", "vllm", "--layout", "sliding",
         "--async-scheduling"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert ("--layout sliding, --async-scheduling needs --engine twin" in done.stderr)
