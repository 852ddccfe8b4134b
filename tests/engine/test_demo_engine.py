"""`kvscope demo --engine vllm` end to end: the probe and the middleware inside a real vLLM
CPU server (~40 s), as a user runs it, with the demo harness of tests/twin/test_demo.py.
Here with the other engine tests, which run in turn on one worker (tests/conftest.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from kvscope.demo.live import Scrape
from tests.engine.conftest import vllm_machine_lock
from tests.twin.test_demo import Demo, assert_gone

pytestmark = pytest.mark.engine


def test_demo_against_a_real_vllm_server(tmp_path: Path) -> None:
    """``--engine vllm``: the probe and the middleware inside a real vLLM server (~40 s)."""
    with vllm_machine_lock():
        demo = Demo(tmp_path, "--engine", "vllm", "--requests", "40")
        try:
            demo.wait_for(r"\(Ctrl-C to stop\)", 400)
            text = demo.text()
            assert "40/40 requests answered (0 failed)" in text, text
            pids = demo.descendants()
            with httpx.Client(base_url=demo.base, timeout=10, trust_env=False) as http:
                m = Scrape(http.get("/metrics").text)
            assert m.value("kvscope_reconciliation_preemptions_diff") == 0, text
            assert m.total("kvscope_client_requests_total") == 40
            ended = m.total("vllm_scheduler_requests_ended_total")
            assert ended >= 38  # the probe may drop records on a loaded machine, and says so
            assert m.total("kvscope_client_traces_joined_total") == ended
            assert "reconciliation    kvscope's preemption count minus vLLM's own" in text
            demo.proc.send_signal(signal.SIGINT)
            assert demo.finish(60) == 130, demo.text()
        finally:
            demo.kill()
        assert_gone(pids)
