"""vLLM must not care whether a sidecar listens: the package's sidecar stopped, vLLM serves
a load in full while the probe drops and counts, and a new sidecar on the same endpoint
resyncs with the same engine. Sorts after the modules that need the first sidecar."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any

import pytest

from kvscope.load.mix import LoadSpec, build_requests, run_load_sync
from tests.engine.figures import (
    ENGINE,
    assert_audit_clean,
    engine_summary,
    sample,
    wait_until_quiet,
)

if TYPE_CHECKING:
    from tests.engine.conftest import EngineStack

pytestmark = pytest.mark.engine


def test_vllm_serves_without_a_sidecar_and_the_probe_reconnects(
        engine_stack: EngineStack, first_engine: dict[str, Any],
        record_property: pytest.RecordProperty) -> None:
    # 1. Nobody listens on the probe's endpoint any more.
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught: -15, not -9.
    assert engine_stack.sidecar.stop() in (0, -signal.SIGTERM), engine_stack.sidecar.log_tail()

    # 2. vLLM serves a bounded load in full; the probe drops its records instead.
    spec = LoadSpec(n_requests=40, concurrency=16, seed=4)
    result = run_load_sync(engine_stack.vllm.url, spec)
    assert result.ok == spec.n_requests, result.errors
    wanted = [body["max_tokens"] for body in build_requests(spec)]
    assert [o.completion_tokens for o in result.outcomes] == wanted

    # 3. A new sidecar on the same endpoint learns the engine from the probe's next keyframe,
    #    which carries the hello: the probe reconnects by itself. Keyframes come with steps,
    #    so keep a small load going until the engine shows up in sync and the sidecar has
    #    compared an audit with its new ledger: one step in 8 carries one, so a load whose
    #    keyframe came in its last few steps can end with none counted.
    engine_stack.sidecar.start()
    restarted = time.monotonic()
    deadline = restarted + 15.0
    loads = 0
    while True:
        small = LoadSpec(n_requests=8, concurrency=8, seed=100 + loads, short_fraction=1.0,
                         max_tokens=(16, 32), timeout_s=30.0)
        assert run_load_sync(engine_stack.vllm.url, small).ok == small.n_requests
        loads += 1
        summary = engine_summary(engine_stack)
        if summary is not None and summary["synced"] and summary["audit_blocks"] > 0:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"no synced, audited engine 0 15 s after the sidecar restarted: {summary}\n"
                        f"{engine_stack.sidecar.log_tail()}")
    resynced_s = time.monotonic() - restarted
    record_property("resynced_after_restart_s", round(resynced_s, 1))
    print(f"engine 0 in sync {resynced_s:.1f} s after the sidecar restarted ({loads} small loads)")
    assert summary["session"] == first_engine["session"], "the engine did not restart"
    assert summary["pid"] == first_engine["pid"]

    _vllm_text, side_text = wait_until_quiet(engine_stack)
    assert sample(side_text, "kvscope_ledger_synced", ENGINE) == 1
    assert sample(side_text, "kvscope_ledger_mismatches_total", ENGINE) == 0
    assert_audit_clean(side_text, ENGINE)
    assert sample(side_text, "kvscope_reconciliation_free_blocks_diff", ENGINE) == 0
    assert sample(side_text, "vllm_scheduler_free_blocks", ENGINE) == engine_stack.num_blocks - 1
    assert sample(side_text, "kvscope_probe_faults_total", ENGINE) == 0
    # Records the probe could not deliver while nobody listened were dropped and counted.
    assert sample(side_text, "kvscope_probe_records_dropped_total", ENGINE) > 0
