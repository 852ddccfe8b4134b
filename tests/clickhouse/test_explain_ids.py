"""Request IDs as callers send them reach ``kvscope explain`` intact: commas and spaces
(vLLM takes an ``X-Request-Id`` as sent), and an ID over 128 characters, which the
middleware sends and the store keeps as its digest.

One twin run (vLLM's real scheduler, the probe, the RequestTracker) of requests named as
vLLM 0.32 names engine requests around such caller IDs; its traces are joined to the
middleware's events by the real ClientJoin, and every row goes through the ClickHouse sink.
What vLLM's scheduler did is taken from the probe's own preemption facts (the hub's
``preemption`` events), not from the rows under test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvscope import cli
from kvscope.explain import answer, render_json
from kvscope.explain.api import explain_router
from kvscope.rows import RequestTrace
from kvscope.state.clients import ClientJoin
from kvscope.state.hashkey import Keyer
from kvscope.state.requests import RequestTracker
from kvscope_probe import wire
from kvscope_probe.middleware import request_key
from tests.clickhouse.conftest import clickhouse_connect, database_name, open_sink

pytestmark = [pytest.mark.clickhouse, pytest.mark.twin]
N = 40
LONG = 3000
"""Characters of the long callers' IDs (one in five): past the middleware's 128, and the
length ``tests/engine/test_probe_target.py`` sends a real server."""


def caller(i: int) -> str:
    """The caller's X-Request-Id of request ``i``: commas and spaces, every fifth one long
    (its digest in the store), one with a requester-like fact in it, one with a slash."""
    if i % 5 == 0:
        return f"long, id {i} " + "y" * (LONG - 12)
    return {3: "x blocks_needed=99, requester=q 3", 4: "team-a/req 4, b"}.get(i, f"a, b c {i}")


def engine_id(i: int) -> str:
    return f"cmpl-{caller(i)}-0-{i:08x}"


@dataclass
class Stored:
    client: Any
    dsn: str
    database: str
    traces: list[RequestTrace]
    preemptions: list[tuple[str, str | None]]
    """(victim, requester) of every preemption, as the probe reported it."""


@pytest.fixture(scope="module")
def stored(chdb_dsn: str, twin_runner: Any, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[Stored]:
    from kvscope.twin import TwinConfig, WorkloadSpec, generate
    from kvscope.twin.probed import ProbedTwin

    db = database_name(request.node.nodeid)
    sink, manager = open_sink(chdb_dsn, db, tmp_path_factory)
    traces: list[RequestTrace] = []
    pt = ProbedTwin(TwinConfig(num_blocks=48), seed=5)
    pt.hub.listeners.append(RequestTracker(
        lambda r: traces.append(r) if isinstance(r, RequestTrace) else manager.emit(r)
    ).on_event)
    seen: list[tuple[str, str | None]] = []
    pt.hub.listeners.append(lambda kind, _st, p: seen.append(
        (p.fact.victim, p.fact.requester)) if kind == "preemption" else None)
    pt.run([replace(r, request_id=engine_id(i))
            for i, r in enumerate(generate(WorkloadSpec(n_requests=N, seed=5)))])
    join = ClientJoin(manager.emit, keyer=Keyer(b"test-ids-secret-0123456789"))
    by_id = {t.request_id: t for t in traces}
    for i in range(N):  # the middleware's start: the caller's ID as it sends it
        t = by_id[engine_id(i)]
        join.on_client(wire.ClientStart(request_key(caller(i)), t.arrival_ts - 0.5,
                                        "completions", "tiny", "ids", "curl/8", "",
                                        "0" * 64, 10, 16, f"call-{i}"))
    for t in traces:
        join.on_trace(t)
    for i in range(N):
        t = by_id[engine_id(i)]
        join.on_client(wire.ClientEnd(request_key(caller(i)), t.ts + 0.5, 200,
                                      t.ts - t.arrival_ts + 1.0, f"call-{i}"))
    join.flush()
    assert join.stats.joined_traces == N
    assert sink.flush(60)
    manager.close()
    client = clickhouse_connect.get_client(dsn=chdb_dsn, database=db)
    yield Stored(client, chdb_dsn, db, traces, seen)
    client.close()


def by_someone_else(s: Stored) -> list[tuple[str, str]]:
    """(victim, requester) of the preemptions another request's growth made."""
    return [(v, r) for v, r in s.preemptions if r and r != v]


def test_callers_ids_with_commas_and_spaces_give_their_own_engine_request(
        stored: Stored) -> None:
    """The engine IDs of a caller's request were stored comma-joined and split on ","
    again: "a, b c 1" gave ["cmpl-a", " b c 1-0-00000001"], neither an engine request."""
    for i in range(N):
        if i % 5 == 0:
            continue
        body = answer.explain(stored.client, caller(i))
        assert [r["request_id"] for r in body["engine_requests"]] == [engine_id(i)]
        jsonschema_valid(body)
        (api,) = body["api_requests"]
        assert api["request_id"] == caller(i)
        assert api["engine_ids"] == [engine_id(i)]
        # and the engine request's own ID finds the caller's row
        back = answer.explain(stored.client, engine_id(i))
        assert [a["request_id"] for a in back["api_requests"]] == [caller(i)]


def test_the_requester_of_each_preemption_is_the_one_vllm_grew(stored: Stored) -> None:
    """The requester was parsed from the space-separated ``detail``: "requester=cmpl-a, b
    c 7-0-00000007 blocks_needed=2" read "cmpl-a,", no request, so no trigger either."""
    pairs = by_someone_else(stored)
    assert pairs, "the run made no preemption by another request's growth"
    assert any(", " in r for _, r in pairs)
    for victim in dict.fromkeys(v for v, _ in pairs):
        body = answer.explain(stored.client, victim)
        (er,) = body["engine_requests"]
        got = [p["requester"] for p in er["preemptions"]]
        want = [r for v, r in stored.preemptions if v == victim]
        assert got == want, (victim, got, want)
        for p in er["preemptions"]:
            assert p["requester_is_victim"] or p["trigger"] is not None, p


def test_a_long_callers_id_is_found_by_its_digest(stored: Stored,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An ID over 128 characters is stored as ``sha256:<hex>`` of itself: explain with the
    caller's own ID said "no request" (CLI exit 3, API 404). The CLI takes any length; the
    API up to 1,024 characters, and the digest of a longer one."""
    raw = caller(10)
    assert len(raw) == LONG
    body = answer.explain(stored.client, raw)
    assert body["request_id"] == raw
    assert [a["request_id"] for a in body["api_requests"]] == [request_key(raw)]
    assert [r["request_id"] for r in body["engine_requests"]] == [engine_id(10)]
    assert cli.main(["explain", raw, "--dsn", stored.dsn, "--database", stored.database,
                     "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["api_requests"][0]["request_id"] == (
        request_key(raw))
    app = FastAPI()
    app.include_router(explain_router(
        lambda: clickhouse_connect.get_client(dsn=stored.dsn, database=stored.database)))
    # the API takes IDs up to MAX_REQUEST_ID characters (a request line uvicorn reads
    # whatever the characters): past it a clear 422, and the digest the store shows (what
    # the dashboards' links carry) answers
    api = TestClient(app)
    r = api.get(f"/api/requests/{raw}")
    assert r.status_code == 422 and "at most 1024 characters" in r.text, r.text[:300]
    r = api.get(f"/api/requests/{request_key(raw)}")
    assert r.status_code == 200, r.text[:300]
    assert [x["request_id"] for x in r.json()["engine_requests"]] == [engine_id(10)]
    mid = "long, id 99 " + "z" * 988  # over 128 and within the API's bound: found raw
    assert api.get(f"/api/requests/{mid}").status_code == 404  # not in the store: looked up
    # its digest, as the store shows it, is still an answer of its own
    assert answer.explain(stored.client, request_key(raw))["engine_requests"] == (
        body["engine_requests"])


def test_the_api_answers_an_id_with_a_slash(stored: Stored) -> None:
    """The route's ``{request_id}`` stopped at a ``/`` (decoded from ``%2F`` before
    routing), so the caller's "team-a/req 4, b" was a 404 from the API and its page."""
    app = FastAPI()
    app.include_router(explain_router(
        lambda: clickhouse_connect.get_client(dsn=stored.dsn, database=stored.database)))
    r = TestClient(app).get("/api/requests/" + quote(caller(4), safe=""))
    assert r.status_code == 200, r.text[:300]
    assert [x["request_id"] for x in r.json()["engine_requests"]] == [engine_id(4)]
    assert TestClient(app).get("/ui/requests/" + quote(caller(4), safe="")).status_code == 200


def test_worst_gives_a_command_that_a_shell_reads_back(stored: Stored) -> None:
    """``--worst`` lists ``kvscope explain <id>`` per request: with a space or a comma in
    the ID the shell split it into several arguments."""
    import shlex

    got = answer.worst(stored.client, N, 0)["requests"]
    assert len(got) == N
    for r in got:
        assert shlex.split(r["command"]) == ["kvscope", "explain", r["request_id"]]


def jsonschema_valid(body: dict[str, Any]) -> None:
    import jsonschema

    jsonschema.validate(json.loads(json.dumps(body)), render_json.schema())
