"""The HTTP surface: health states and the token guard, through a real ASGI client."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.sidecar.http.app import create_app
from kvscope.sidecar.http.pressure import preempt_rate
from kvscope.state.hub import Hub
from kvscope_probe import wire
from tests.unit.test_hub import feed, keyframe
from tests.unit.test_wire import hello, step


def client(hub: Hub, **kw: object) -> TestClient:
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub))
    return TestClient(create_app(hub, reg, **kw))  # type: ignore[arg-type]


def test_healthz_is_liveness_and_readyz_follows_the_probe() -> None:
    hub = Hub()
    c = client(hub, health_timeout_s=0.3)
    assert c.get("/healthz").status_code == 200  # the sidecar works, with or without probes
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "no probe connected"
    feed(hub, [hello(), step(), keyframe()], 0)
    r = c.get("/readyz")
    assert r.status_code == 200 and [e["state"] for e in r.json()["engines"]] == ["active"]
    time.sleep(0.4)
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "probe silent"
    assert [e["state"] for e in r.json()["engines"]] == ["silent"]
    assert c.get("/healthz").status_code == 200


def test_engines_api_summarises_each_engine() -> None:
    hub = Hub()
    feed(hub, [hello(), step(), keyframe()], 0)
    (e,) = client(hub, health_timeout_s=30).get("/api/engines").json()["engines"]
    assert (e["engine"], e["num_blocks"], e["synced"], e["free_blocks"]) == ("0", 8, True, 7)


def test_token_guards_every_route_but_the_health_probes() -> None:
    c = client(Hub(), health_timeout_s=30, token="t0k")
    assert c.get("/metrics").status_code == 401
    assert c.get("/api/engines", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/metrics", headers={"Authorization": "Bearer t0k"}).status_code == 200
    assert c.get("/healthz").status_code == 200  # open: liveness
    assert c.get("/readyz").status_code == 503  # open, and honest: no probe yet


def _full_pool(waiting: int, free_states: int = 0) -> Hub:
    """One engine whose pool has ``free_states`` free blocks of 7 usable, ``waiting``
    requests waiting."""
    hub = Hub()
    states = bytes([3] + [0] * free_states + [2] * (7 - free_states))
    kf = wire.Keyframe(hello=hello(), states=states, tables={}, tokens={})
    feed(hub, [hello(), step(free_blocks=free_states, waiting=waiting), kf], 0)
    return hub


def test_preempt_rate_reads_the_pools_of_connected_engines_only() -> None:
    """A crashed engine's last pool (no free block, requests waiting) stayed in the
    answer until the hub forgot the engine an hour later: an autoscaler read "shed" for
    that hour, and "engines" counted the dead one."""
    hub = _full_pool(waiting=3)
    c = client(hub, health_timeout_s=0.3)
    r = c.get("/health/preempt-rate").json()
    assert (r["recommendation"], r["engines"], r["waiting"], r["free_block_ratio"]) == (
        "shed", 1, 3, 0.0)
    time.sleep(0.4)  # the probe went silent
    r = c.get("/health/preempt-rate").json()
    assert (r["recommendation"], r["engines"], r["waiting"], r["free_block_ratio"]) == (
        "ok", 0, 0, None)


def test_no_free_block_while_requests_wait_is_one_engines_state() -> None:
    """One engine full with nothing waiting, another with free blocks and requests
    waiting: no engine has requests waiting on a full pool, so the rule does not shed
    (it read the first's free blocks with the second's queue)."""
    full_idle = _full_pool(waiting=0).engines["0"]
    roomy_busy = _full_pool(waiting=5, free_states=4).engines["0"]
    r = preempt_rate([full_idle, roomy_busy], 60)
    assert (r["free_block_ratio"], r["waiting"], r["recommendation"]) == (0.0, 5, "backoff")
    assert preempt_rate([_full_pool(waiting=2).engines["0"], roomy_busy], 60)[
        "recommendation"] == "shed"
