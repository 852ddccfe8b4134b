"""The HTTP surface: health states and the token guard, through a real ASGI client."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.sidecar.http.app import create_app
from kvscope.state.hub import Hub
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
