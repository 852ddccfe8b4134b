"""Reading a real vLLM server and its sidecar in the engine tests: one sample of an
exposition, the sidecar's summary of engine "0", waiting until it is in sync or quiet, a
saved query on a stopped sidecar's store."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from tests.engine.conftest import EngineStack

ENGINE = {"engine": "0"}
REASONS = ("kv_full", "priority", "unknown")


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The value of the one sample called ``name`` whose labels include ``labels``."""
    want = labels or {}
    found = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]
    if len(found) != 1:
        raise LookupError(f"{len(found)} samples named {name} with labels {want}")
    return float(found[0])


def assert_audit_clean(text: str, labels: dict[str, str]) -> None:
    """The audit compared vLLM's own pool with the ledger and found nothing different,
    for each of its kinds, exactly 0."""
    assert sample(text, "kvscope_audit_blocks_total", labels) > 0
    for kind in ("block_state", "request_table", "probe_mirror"):
        assert sample(text, "kvscope_audit_mismatches_total", {**labels, "kind": kind}) == 0


def get_text(url: str) -> str:
    response = httpx.get(url, timeout=5.0, trust_env=False)
    response.raise_for_status()
    return response.text


def engine_summary(stack: EngineStack) -> dict[str, Any] | None:
    """The sidecar's /api/engines entry for engine "0", or None."""
    body = httpx.get(f"{stack.sidecar.url}/api/engines", timeout=5.0, trust_env=False).json()
    return next((e for e in body["engines"] if e["engine"] == "0"), None)


def wait_for_synced_engine(stack: EngineStack, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        summary = engine_summary(stack)
        if summary is not None and summary["synced"]:
            return summary
        if time.monotonic() > deadline:
            pytest.fail(f"sidecar has no synced engine 0 after {timeout_s:.0f} s: {summary}\n"
                        f"{stack.sidecar.log_tail()}")
        time.sleep(0.2)


def wait_until_quiet(stack: EngineStack, timeout_s: float = 60.0) -> tuple[str, str]:
    """Wait until vLLM runs and queues nothing, the sidecar's last step says the same and no
    step followed it, and the sidecar has scraped vLLM twice since vLLM went idle.

    Returns (vLLM's exposition, the sidecar's), read after that.
    """
    deadline = time.monotonic() + timeout_s
    scrapes_when_idle: float | None = None
    last_steps: float | None = None
    while True:
        vllm_text = get_text(f"{stack.vllm.url}/metrics")
        side_text = get_text(f"{stack.sidecar.url}/metrics")
        vllm_idle = (sample(vllm_text, "vllm:num_requests_running", ENGINE) == 0
                     and sample(vllm_text, "vllm:num_requests_waiting", ENGINE) == 0)
        scrapes = sample(side_text, "kvscope_vllm_scrapes_total")
        if not vllm_idle:
            scrapes_when_idle = None
        elif scrapes_when_idle is None:
            scrapes_when_idle = scrapes
        steps = sample(side_text, "vllm_scheduler_steps_total", ENGINE)
        side_idle = (sample(side_text, "vllm_scheduler_running_requests", ENGINE) == 0
                     and sample(side_text, "vllm_scheduler_waiting_requests", ENGINE) == 0
                     and steps == last_steps)
        last_steps = steps
        if vllm_idle and side_idle and scrapes >= (scrapes_when_idle or 0) + 2:
            return get_text(f"{stack.vllm.url}/metrics"), get_text(f"{stack.sidecar.url}/metrics")
        if time.monotonic() > deadline:
            pytest.fail(f"not quiet after {timeout_s:.0f} s: vLLM idle {vllm_idle}, sidecar "
                        f"idle {side_idle}; engine 0: {engine_summary(stack)}")
        time.sleep(0.25)


def saved_query(stack: EngineStack, name: str, *params: str) -> str:
    """``kvscope query NAME --format json`` on the stopped sidecar's embedded store, as a
    user would run it (the store opens in one process at a time)."""
    dsn = f"chdb://{stack.sidecar.workdir / 'data' / 'chdb'}"
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "query", name, "--dsn", dsn,
         *(a for p in params for a in ("--param", p)), "--format", "json"],
        capture_output=True, text=True, timeout=120, check=True).stdout
