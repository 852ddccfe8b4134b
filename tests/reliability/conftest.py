"""Reliability and security tests: kvscope never harms vLLM, never loses a trace, never
lets anyone in.

They start real ``kvscope serve`` processes on free 127.0.0.1 ports (stopped by PID in a
``finally``), drive vLLM's real scheduler in the twin, and keep every file under
``tmp_path``. Run them with ``pytest tests/reliability``; about four minutes, of which
a 30 s stalled sidecar and a 60 s store outage are waits by design.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _quiet_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
