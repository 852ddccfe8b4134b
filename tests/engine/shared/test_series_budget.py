"""The series budget on a real vLLM CPU server: with the probe, the middleware and the
sidecar scraping vLLM's /metrics, the one engine exports exactly ``series_budget``'s table
for a reconciled engine, and the sidecar nothing outside its own table.

What a run decides is read from the scrape: which finish statuses vLLM reported, which
tables each sink wrote to, and (the server is shared with the package's earlier modules)
which clients and user agents sent requests and which per-client families have a series;
every other family's count is predicted.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.sidecar.exposition.series_budget import (
    AGENT_FAMILIES,
    CLIENT_FAMILIES,
    EngineShape,
    SidecarShape,
    engine_series,
    scraped,
    sidecar_series,
)
from tests.engine.conftest import EngineStack
from tests.engine.figures import get_text, wait_for_synced_engine
from tests.reliability.serveproc import wait_until

pytestmark = pytest.mark.engine


def labels_of(text: str, sample: str, label: str) -> Counter[str]:
    return Counter(s.labels[label] for fam in text_string_to_metric_families(text)
                   for s in fam.samples if s.name == sample)


def test_a_real_engine_exports_exactly_its_budget(engine_stack: EngineStack) -> None:
    for i, (max_tokens, stop) in enumerate([(8, None), (16, None), (8, ["w"])]):
        r = httpx.post(f"{engine_stack.vllm.url}/v1/completions", timeout=60.0,
                       trust_env=False, headers={"X-Client-Id": "budget",
                                                 "User-Agent": "budget/1"},
                       json={"model": "tiny", "prompt": f"w{i} w2 w3 w4",
                             "max_tokens": max_tokens, "stop": stop})
        assert r.status_code == 200, r.text
    wait_for_synced_engine(engine_stack, timeout_s=30.0)
    # the reconciliation gauges come with the sidecar's first scrape of vLLM's /metrics
    # since the engine appeared (every few seconds; later on a loaded machine)
    wait_until("a scrape of vLLM's /metrics reconciled", lambda: "kvscope_reconciliation_"
               "preemptions_diff{" in get_text(f"{engine_stack.sidecar.url}/metrics"), 60)
    # the middleware's client events reach the sidecar apart from the engine's records
    # (and are taken up to receiver.TAKE_EVERY_S after they arrive)
    wait_until("the budget client's requests counted",
               lambda: 'kvscope_client_requests_total{client="budget"}' in
               get_text(f"{engine_stack.sidecar.url}/metrics"), 30)
    text = get_text(f"{engine_stack.sidecar.url}/metrics")
    statuses = labels_of(text, "vllm_scheduler_requests_ended_total", "status")
    tables = labels_of(text, "kvscope_sink_errors_total", "sink")
    sinks = {sink: labels_of(text, "kvscope_sink_rows_written_total", "sink")[sink]
             for sink in tables}
    # the audit's pass time is exported once it has covered the pool (at most 4,096
    # steps; the shared server may have run fewer so far)
    seen = httpx.get(f"{engine_stack.sidecar.url}/api/engines", timeout=10.0,
                     trust_env=False).json()
    passed = any(e["audit_pass_seconds"] is not None for e in seen["engines"])
    engine = engine_series(EngineShape(kv_groups=1, end_statuses=len(statuses),
                                       reconciled=True, audit_passed=passed))
    # The package's earlier modules sent requests of their own clients and agents: each
    # per-client family holds at most one series per client label value (a client that
    # was never preempted has no preemption series); every other family is exact.
    clients = labels_of(text, "kvscope_client_requests_total", "client")
    agents = labels_of(text, "kvscope_user_agent_requests_total", "user_agent")
    assert "budget" in clients and "budget/1" in agents
    # the sidecar's own CPU: its named threads (store, decision log and vLLM scrapes on),
    # the main one (uvicorn's), the rest (the embedded store's own, libzmq's)
    threads = set(labels_of(text, "kvscope_sidecar_cpu_seconds_total", "thread"))
    assert threads == {"receiver", "ingest", "layout", "decision-log", "vllm-scraper",
                       "clickhouse-batc", "clickhouse-send", "main", "other"}
    want = engine + sidecar_series(SidecarShape(
        sinks, clients=len(clients), agents=len(agents), client_families=(),
        agent_families=(), vllm_scrapes=True, threads=len(threads)))
    got = scraped(text)
    per_client = {f"kvscope_client_{f}_total": len(clients) for f in CLIENT_FAMILIES}
    per_client |= {f"kvscope_user_agent_{f}_total": len(agents) for f in AGENT_FAMILIES}
    for name, most in per_client.items():
        assert got.pop(name, 0) <= most, name
    print(f"\nseries budget on vLLM: one engine {sum(engine.values())} series "
          f"(statuses {sorted(statuses)}), the sidecar {sum(got.values())} in all "
          f"(sinks {sinks})")
    assert got == want
