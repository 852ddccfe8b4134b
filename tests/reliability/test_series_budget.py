"""The series budget holds on a real ``kvscope serve``: one engine fed frames recorded from
vLLM's real scheduler exports exactly ``series_budget``'s table, sample name by sample name,
and 10,000 distinct clients (client ID, User-Agent and API key each new) sent through the
real middleware add exactly the capped client series, never one more."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvscope.sidecar.exposition.series_budget import (
    MAX_END_STATUSES,
    EngineShape,
    SidecarShape,
    ceiling,
    engine_series,
    scraped,
    sidecar_series,
)
from kvscope.state.clients import ClientJoin
from kvscope.state.hashkey import Keyer
from kvscope_probe import wire
from kvscope_probe.middleware import KVScopeMiddleware
from tests.reliability.serveproc import ServeProcess, wait_until
from tests.reliability.test_fuzz_http import push, stand_in
from tests.reliability.test_fuzz_wire import real_frames

pytestmark = [pytest.mark.reliability, pytest.mark.twin]

FLOOD = 10_000
SINKS = {"decision_log": 1}
"""``--clickhouse-dsn off`` leaves the decision log, writing one table."""
TWIN = EngineShape(kv_groups=1, end_statuses=1)
"""The recorded twin run: one full-attention group; every request ends length-capped."""
THREADS = {"receiver", "ingest", "layout", "decision-log", "main", "other"}
"""The sidecar's own CPU by thread: its named threads with the store off, the main one
(uvicorn's), the rest (libzmq's)."""


def thread_labels(text: str) -> set[str]:
    return {s.labels["thread"] for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "kvscope_sidecar_cpu_seconds_total"}


def client_requests(side: ServeProcess) -> float:
    return sum(v for (name, _), v in side.metrics().items()
               if name == "kvscope_client_requests_total")


@pytest.fixture(scope="module")
def side(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    frames = real_frames()  # ends with one middleware call, which the sidecar writes unjoined
    # The recorded engine's last heartbeat comes once, below, and the flood of 10,000 calls
    # takes 30 s and more: past the default health timeout (30 s) the engine reads silent
    # and its pool and queue gauges are withheld (17 series short, a failure CI met). A
    # live probe heartbeats every second; this sidecar waits longer instead.
    proc = ServeProcess(tmp_path_factory.mktemp("budget"),
                        args=["--clickhouse-dsn", "off", "--log-level", "warning",
                              "--health-timeout", "3600"])
    try:
        proc.start()
        # the engine idle after the call, as a live probe says it: a heartbeat stamped
        # after the call's answer (the sidecar writes the call's row once every engine's
        # records have passed its answer, or the engine fell silent)
        engine = frames[0]
        idle = wire.Frame(engine=engine.engine, session=engine.session, first_seq=0,
                          dropped=0, faults=0,
                          records=[wire.Heartbeat(ts=time.time(), since_step_s=1.0)])
        push(proc.endpoint, [wire.encode(f) for f in [*frames, idle]])
        wait_until("the engine to be synced", lambda: (e := proc.engines()) and e[0]["synced"],
                   30)
        wait_until("the recorded client call", lambda: client_requests(proc) == 1, 30)
        yield proc
    finally:
        proc.stop()


def test_one_engine_exports_exactly_its_budget(side: ServeProcess) -> None:
    text = side.get("/metrics").text
    got = scraped(text)
    assert thread_labels(text) == THREADS
    want = engine_series(TWIN) + sidecar_series(SidecarShape(SINKS, clients=1, agents=1,
                                                             threads=len(THREADS)))
    print(f"\nseries budget: one engine {sum(engine_series(TWIN).values())} series, the "
          f"sidecar {sum(got.values())} in all")
    assert got == want


def test_ten_thousand_clients_stay_within_the_budget(side: ServeProcess) -> None:
    app = stand_in()
    app.add_middleware(KVScopeMiddleware, endpoint=side.endpoint)
    caps = ClientJoin(lambda _row: None, keyer=Keyer(b"caps-only-test-secret")).stats
    max_clients, max_agents = caps.clients.limit, caps.agents.limit
    with TestClient(app) as client:
        for i in range(FLOOD):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                            headers={"X-Client-Id": f"tenant-{i}", "User-Agent": f"flood/{i}",
                                     "Authorization": f"Bearer sk-{i}"})
            assert r.status_code == 200
    wait_until(f"{FLOOD + 1} client requests in /metrics",
               lambda: client_requests(side) == FLOOD + 1, 120)
    text = side.get("/metrics").text
    got = scraped(text)
    # every label slot taken (the recorded call's client among them), plus ``other``
    want = engine_series(TWIN) + sidecar_series(
        SidecarShape(SINKS, clients=max_clients + 1, agents=max_agents + 1,
                     threads=len(THREADS)))
    limit = ceiling(1, max_clients, max_agents, SINKS)
    m = side.metrics()
    folded = {lbl: m[("kvscope_client_label_overflow_total", frozenset({"label": lbl}.items()))]
              for lbl in ("client", "user_agent")}
    print(f"\nflood: {FLOOD} distinct clients -> {sum(got.values())} series (budget "
          f"{limit}), folded into other: {folded}")
    assert got == want
    assert sum(got.values()) <= limit
    assert folded == {"client": FLOOD + 1 - max_clients, "user_agent": FLOOD + 1 - max_agents}
    assert m[("kvscope_client_requests_total", frozenset({"client": "other"}.items()))] == (
        FLOOD + 1 - max_clients)


def test_the_ceiling_counts_every_family_at_its_worst() -> None:
    # vLLM's six finished statuses and ``other``
    worst: Any = engine_series(EngineShape(kv_groups=2, end_statuses=MAX_END_STATUSES,
                                           reconciled=True))
    assert MAX_END_STATUSES == 7 and worst["vllm_scheduler_requests_ended_total"] == 7
    assert worst["vllm_scheduler_kv_group_request_blocks"] == 2
    assert sum(worst.values()) == sum(engine_series(TWIN).values()) + 2 + 6 + 2
    assert ceiling(2, 50, 20, SINKS, kv_groups=2) - ceiling(1, 50, 20, SINKS, kv_groups=2) == (
        sum(worst.values()))
