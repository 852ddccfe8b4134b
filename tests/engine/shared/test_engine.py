"""A real vLLM server on the CPU with the probe and the client middleware, and a real
sidecar: kvscope's counts must reconcile with vLLM's own /metrics, clients must join their
traces, and vLLM must not care whether a sidecar listens.

The tests run first on the package's server (``tests/engine/shared/conftest.py``): the
reconciliation test needs the sidecar that has watched the engine since its first step.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.localvllm.server import live_group_pids
from tests.conftest import SUITE_VLLM_NICE
from tests.engine.figures import (
    ENGINE,
    REASONS,
    assert_audit_clean,
    get_text,
    sample,
    wait_until_quiet,
)

if TYPE_CHECKING:
    from tests.engine.conftest import EngineStack

pytestmark = pytest.mark.engine

class LoadWatcher(threading.Thread):
    """Reads the sidecar's /metrics while a load runs: the free-blocks reconciliation gauge
    and how many probe records have arrived (a stalled sidecar shows as a flat line)."""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        super().__init__(name="kvscope-load-watcher", daemon=True)
        self.url = url
        self.interval_s = interval_s
        self.diffs: list[float] = []
        self.records: list[tuple[float, float]] = []
        """(seconds since start, records received so far)."""
        self.absent = 0
        self.errors = 0
        self.stop_event = threading.Event()
        self._t0 = time.monotonic()

    def run(self) -> None:
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while not self.stop_event.wait(self.interval_s):
                try:
                    text = client.get(f"{self.url}/metrics").text
                    self.records.append((round(time.monotonic() - self._t0, 1),
                                         sample(text, "kvscope_probe_records_received_total")))
                    self.diffs.append(
                        sample(text, "kvscope_reconciliation_free_blocks_diff", ENGINE))
                except LookupError:  # the diff is absent while the ledger is not in sync
                    self.absent += 1
                except Exception:  # noqa: BLE001 - counted and reported; never crash a thread
                    self.errors += 1


def wait_reconciled(url: str, timeout_s: float = 60.0) -> None:
    """Until the sidecar has read vLLM's /metrics once: before that its reconciliation
    gauges are absent whatever the ledger (the watcher reads an absent diff as a ledger out
    of sync, so the load starts after this)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sample(get_text(f"{url}/metrics"), "kvscope_reconciliation_free_blocks_diff", ENGINE)
            return
        except LookupError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_probe_runs_in_the_engine_core_process(engine_stack: EngineStack,
                                               first_engine: dict[str, Any]) -> None:
    assert first_engine["num_blocks"] == engine_stack.num_blocks
    assert first_engine["block_size"] == 32
    assert first_engine["model"] == "tiny"
    assert first_engine["vllm_version"] == "0.32.0"
    assert first_engine["policy"] == "fcfs"
    pid = first_engine["pid"]
    assert pid != engine_stack.vllm.pid, "the probe records in the API server, not EngineCore"
    os.kill(pid, 0)  # alive (raises ProcessLookupError otherwise)
    assert pid in live_group_pids(engine_stack.vllm.pid), "not one of this server's processes"
    # Every process of the server runs at the suite's niceness (tests/conftest.py), the
    # EngineCore (where the probe records) and its worker included.
    group = live_group_pids(engine_stack.vllm.pid)
    assert len(group) >= 3
    assert {os.getpriority(os.PRIO_PROCESS, p) for p in group} == {SUITE_VLLM_NICE}


def test_counts_reconcile_with_vllm_after_a_mixed_load(
        engine_stack: EngineStack, first_engine: dict[str, Any],
        record_property: pytest.RecordProperty) -> None:
    spec = LoadSpec(n_requests=120, concurrency=32, seed=3)
    wait_reconciled(engine_stack.sidecar.url)
    watcher = LoadWatcher(engine_stack.sidecar.url)
    watcher.start()
    try:
        result = run_load_sync(engine_stack.vllm.url, spec)
    finally:
        watcher.stop_event.set()
        watcher.join(10)
    assert result.ok == spec.n_requests, result.errors

    started = time.monotonic()
    vllm_text, side_text = wait_until_quiet(engine_stack)
    vllm_preemptions = sample(vllm_text, "vllm:num_preemptions_total", ENGINE)
    by_reason = {r: sample(side_text, "vllm_scheduler_preempted_requests_total",
                           {**ENGINE, "reason": r}) for r in REASONS}
    usage = sample(vllm_text, "vllm:kv_cache_usage_perc", ENGINE)
    vllm_free = round((1.0 - usage) * (engine_stack.num_blocks - 1))
    side_free = sample(side_text, "vllm_scheduler_free_blocks", ENGINE)
    figures = {
        "load_s": round(result.elapsed_s, 1), "quiet_after_s": round(time.monotonic() - started, 1),
        "preemptions_vllm": vllm_preemptions, "preemptions_kvscope": by_reason,
        "free_blocks_vllm": vllm_free, "free_blocks_kvscope": side_free,
        "max_abs_free_blocks_diff_under_load": max((abs(d) for d in watcher.diffs), default=None),
        "free_blocks_diffs_under_load": watcher.diffs, "diff_absent": watcher.absent,
        "watch_errors": watcher.errors, "records_received_under_load": watcher.records,
        "frames": sample(side_text, "kvscope_probe_frames_received_total"),
        "records": sample(side_text, "kvscope_probe_records_received_total"),
        "steps": sample(side_text, "vllm_scheduler_steps_total", ENGINE),
    }
    for name, value in figures.items():
        record_property(name, value)
    print(f"engine reconciliation figures: {figures}")

    # The probe's own health first: with records lost, no count below could agree.
    assert sample(side_text, "kvscope_probe_records_dropped_total", ENGINE) == 0
    assert sample(side_text, "kvscope_ledger_gaps_total", ENGINE) == 0
    assert sample(side_text, "kvscope_probe_faults_total", ENGINE) == 0
    assert sample(side_text, "kvscope_ledger_synced", ENGINE) == 1
    assert sample(side_text, "kvscope_ledger_mismatches_total", ENGINE) == 0
    assert_audit_clean(side_text, ENGINE)
    # Every request kvscope saw arrive (the first_engine one and the load) also ended.
    arrived = sample(side_text, "vllm_scheduler_requests_arrived_total", ENGINE)
    ended = sample(side_text, "vllm_scheduler_requests_ended_total",
                   {**ENGINE, "status": "FINISHED_LENGTH_CAPPED"})
    assert arrived == ended == 1 + spec.n_requests

    assert sum(by_reason.values()) == vllm_preemptions > 0
    assert by_reason["unknown"] == 0 and by_reason["priority"] == 0  # fcfs: all kv_full
    # vLLM is idle: every usable block is free (prefix-cached ones count), on both sides.
    assert side_free == vllm_free == engine_stack.num_blocks - 1
    assert sample(side_text, "kvscope_reconciliation_preemptions_diff", ENGINE) == 0
    assert sample(side_text, "kvscope_reconciliation_free_blocks_diff", ENGINE) == 0
    # Under load the diff compares the ledger now with vLLM's gauge at its last scrape, so
    # its value there is timing; what is exact: the ledger stayed in sync at every reading
    # (the diff is absent otherwise), each reading worked, and records kept arriving.
    readings = len(watcher.records)
    assert watcher.errors == 0 and watcher.absent == 0, figures
    assert readings > 0 and len(watcher.diffs) == readings, figures
    received = [n for _t, n in watcher.records]
    assert received == sorted(received) and received[-1] > received[0], figures


def ended_total(text: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm_scheduler_requests_ended_total")


def test_clients_join_their_traces_and_a_resubmission_is_flagged(
    engine_stack: EngineStack,
) -> None:
    """The middleware in vLLM's API server: every engine trace carries its client (each
    request went through the middleware), and the same prompt sent twice by one client
    within seconds is a duplicate."""
    metrics = f"{engine_stack.sidecar.url}/metrics"
    before = get_text(metrics)
    joined0 = sample(before, "kvscope_client_traces_joined_total")
    unjoined0 = sample(before, "kvscope_client_traces_unjoined_total")
    ended0 = ended_total(before)
    spec = LoadSpec(n_requests=40, concurrency=16, seed=7, headers={"X-Client-Id": "team-a"})
    assert run_load_sync(engine_stack.vllm.url, spec).ok == spec.n_requests
    body = {"model": "tiny", "prompt": "w1 w2 w3 w4 w5 w6 w7 w8", "max_tokens": 8,
            "ignore_eos": True}
    for _ in range(2):
        r = httpx.post(f"{engine_stack.vllm.url}/v1/completions", json=body, timeout=60,
                       headers={"X-Client-Id": "retry-bot"}, trust_env=False)
        assert r.status_code == 200
    wait_until_quiet(engine_stack)
    deadline = time.monotonic() + 20  # traces wait up to 5 s for their client event
    while True:
        text = get_text(metrics)
        ended = ended_total(text) - ended0
        joined = sample(text, "kvscope_client_traces_joined_total") - joined0
        requests = sample(text, "kvscope_client_requests_total", {"client": "team-a"})
        # a call's row is written once every engine has reported past its answer
        retried = sum(s.value for fam in text_string_to_metric_families(text)
                      for s in fam.samples if s.name == "kvscope_client_requests_total"
                      and s.labels.get("client") == "retry-bot")
        if (joined == ended == spec.n_requests + 2 and requests == spec.n_requests
                and retried == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert joined == ended == spec.n_requests + 2, (joined, ended)
    assert sample(text, "kvscope_client_traces_unjoined_total") == unjoined0
    assert requests == spec.n_requests
    assert sample(text, "kvscope_client_duplicate_requests_total", {"client": "retry-bot"}) == 1
    assert sample(text, "kvscope_client_requests_total", {"client": "retry-bot"}) == 2
