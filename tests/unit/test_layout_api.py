"""/api/layout, /api/layout/history and /ui through a real ASGI client."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvscope.layout.api import layout_router
from kvscope.layout.sampler import LayoutSampler
from kvscope.sidecar.http.app import create_app
from kvscope.state.hub import Hub
from kvscope_probe import wire
from tests.unit.test_hub import feed
from tests.unit.test_layout import C, F, N, U, pool
from tests.unit.test_wire import step

SCHEMA = json.loads((resources.files("kvscope.layout") / "layout.schema.json").read_text())


def valid(body: Any, definition: str) -> None:
    jsonschema.validate(body, {**SCHEMA, "$ref": f"#/$defs/{definition}"})


def client(hub: Hub, sampler: LayoutSampler, token: str | None = None) -> TestClient:
    app = create_app(hub, CollectorRegistry(), health_timeout_s=30, token=token)
    app.include_router(layout_router(hub, sampler))
    return TestClient(app)


def busy() -> tuple[Hub, LayoutSampler]:
    hub = pool([N, U, U, F, U, U, C, C, F, U], {"a": [[1, 2, 9]], "b": [[4, 5]]},
               {"a": 40, "b": 20})
    pre = wire.Preemption("b", 2, 0, 20, 0, 0, "a", 0, 1, "fcfs", "kv_full", 5.0)
    feed(hub, [step(preemptions=[pre], preempted=["c"], free_blocks=4)], 3)
    sampler = LayoutSampler(hub)
    sampler.tick(now=50.0)
    return hub, sampler


def test_layout_is_run_length_encoded_and_matches_its_schema() -> None:
    hub, sampler = busy()
    body = client(hub, sampler).get("/api/layout").json()
    valid(body, "layout_response")
    (e,) = body["engines"]
    assert e["status"] == "ok" and e["pid"] == 1
    lay = e["layout"]
    assert sum(r[3] for r in lay["runs"]) == lay["blocks_covered"] == e["num_blocks"] == 10
    assert [o["req_id"] for o in lay["owners"]] == ["a", "b"]
    assert lay["summary"]["max_contiguous_free_blocks"] == 3
    (p,) = e["preemptions"]
    facts = (p["victim"], p["reason"], p["blocks_needed"], p["free_blocks"])
    assert facts == ("b", "kv_full", 1, 0)
    assert p["max_contiguous_free_blocks"] == 3
    assert e["history"]["free_blocks"] == [4]


def test_runs_are_capped_and_the_cap_is_said() -> None:
    hub, sampler = busy()
    lay = client(hub, sampler).get("/api/layout", params={"max_runs": 2}).json()
    lay = lay["engines"][0]["layout"]
    assert lay["truncated"] and len(lay["runs"]) == 2 and lay["runs_total"] == 7
    assert lay["blocks_covered"] == 3


def test_a_stale_engine_gets_no_layout() -> None:
    hub, sampler = busy()
    feed(hub, [step()], 10)  # a gap
    sampler.tick(now=1e12)
    body = client(hub, sampler).get("/api/layout").json()
    valid(body, "layout_response")
    e = body["engines"][0]
    assert e["status"] == "stale" and e["layout"] is None and e["last_synced_ts"] is not None
    assert e["history"]["free_blocks"][-1] is None


def test_history_filters_by_time_and_checks_its_input() -> None:
    hub, sampler = busy()
    for t in (100.0, 101.0, 102.0):
        sampler.tick(now=t)
    c = client(hub, sampler)
    body = c.get("/api/layout/history", params={"since": 100.5, "until": 102}).json()
    valid(body, "history_response")
    assert [s["ts"] for s in body["snapshots"]] == [101.0, 102.0]
    iso = c.get("/api/layout/history", params={
        "engine": "0", "since": "1970-01-01T00:01:40.5Z", "until": "1970-01-01T00:01:42"})
    assert [s["ts"] for s in iso.json()["snapshots"]] == [101.0, 102.0]
    limited = c.get("/api/layout/history", params={"since": 0, "until": 200, "limit": 1}).json()
    assert limited["truncated"] and [s["ts"] for s in limited["snapshots"]] == [102.0]
    assert c.get("/api/layout/history", params={"since": "yesterday"}).status_code == 422
    # times a store cannot hold, or an empty range: said so, not a 503 or a silent nothing
    for bad in ({"since": "1e306"}, {"until": "1e300"}, {"since": "-5"},
                {"since": 2_000_000_000, "until": 0}):
        r = c.get("/api/layout/history", params=bad)
        assert r.status_code == 422, (bad, r.status_code, r.text)
    assert c.get("/api/layout/history", params={"engine": "9"}).status_code == 404
    assert c.get("/api/layout", params={"engine": "9"}).status_code == 404


def test_ui_is_one_self_contained_page() -> None:
    hub, sampler = busy()
    r = client(hub, sampler).get("/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "<canvas" in html and "api/layout" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert not re.search(r"""(fetch|import)\(\s*["']https?:""", html)


def test_the_token_guards_the_layout_api() -> None:
    hub, sampler = busy()
    c = client(hub, sampler, token="t0k")
    assert c.get("/api/layout").status_code == 401
    assert c.get("/api/layout", headers={"Authorization": "Bearer t0k"}).status_code == 200


@pytest.mark.parametrize("bad", [{"max_runs": 0}, {"history_points": -1}])
def test_bad_parameters_are_refused(bad: dict[str, int]) -> None:
    hub, sampler = busy()
    assert client(hub, sampler).get("/api/layout", params=bad).status_code == 422
