"""Property 5b-d: hostile HTTP input never gets a 5xx, a body over the limit gets 413, and
hostile client headers cannot raise the metrics' label cardinality past its cap.

One real ``kvscope serve`` child serves the module. It first gets probe frames recorded from
vLLM's real scheduler (so every route has state to show) and poison frames (a step whose
timestamp is infinite, which once stopped the receiver for good), then schemathesis draws
requests for every operation of its own /openapi.json, valid and invalid.
"""

from __future__ import annotations

import importlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import schemathesis
import zmq
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from kvscope.sidecar.http.bodylimit import MAX_BODY_BYTES
from kvscope.state.clients import ClientJoin
from kvscope.state.hashkey import Keyer
from kvscope_probe import wire
from kvscope_probe.middleware import KVScopeMiddleware
from tests.reliability.serveproc import ServeProcess, wait_until
from tests.reliability.test_fuzz_wire import real_frames

pytestmark = [pytest.mark.reliability, pytest.mark.twin]

EXAMPLES = 150
"""Cases per operation and generation mode."""


def _load_schemathesis_now() -> None:
    """schemathesis imports most of itself lazily, at the first schema it loads and the
    first case it draws, and pytest rewrites each such module with ``ast.parse``. CPython
    3.11.7's AST constructor keeps its recursion depth per interpreter, not per thread
    (python/cpython#106905): in CI, such a rewrite during the test, after the ``served``
    fixture had imported vLLM in this process (and its threads), failed with "SystemError:
    AST constructor recursion depth mismatch". Loading a schema and drawing a case of each
    mode here, at collection, does those imports before any of that runs."""
    doc = {"openapi": "3.1.0", "info": {"title": "t", "version": "1"}, "paths": {"/x": {"get": {
        "parameters": [{"name": "n", "in": "query", "required": True,
                        "schema": {"type": "integer", "minimum": 0}}],
        "responses": {"200": {"description": "ok"}}}}}}
    op = next(iter(schemathesis.openapi.from_dict(doc).get_all_operations())).ok()

    def draw(case: Any) -> None:
        case.as_transport_kwargs(base_url="http://127.0.0.1:9")

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        settings(max_examples=1, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))(
            given(case=op.as_strategy(generation_mode=mode))(draw))()
    importlib.import_module("hypothesis.internal.conjecture.optimiser")  # a long run's


_load_schemathesis_now()


def push(endpoint: str, messages: list[list[bytes]]) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(endpoint)
        for parts in messages:
            sock.send_multipart(parts)
        sock.close()
    finally:
        ctx.term()


def poison(frames: list[wire.Frame]) -> list[list[bytes]]:
    """Frames of the live session whose steps carry non-finite numbers."""
    last = frames[-1]
    seq = last.first_seq + len(last.records)
    step = [r for f in frames for r in f.records if isinstance(r, wire.Step)][-1]
    quiet = msgspec.structs.replace(
        step, ops=[], new_reqs=[], cached_ids=[], cached_computed=[], grown_ids=[],
        grown_blocks=[], resumed=[], nulled=[], relocated=[], finished=[], preempted=[],
        preemptions=[],
        arrivals=[], ends=[])
    return [wire.encode(msgspec.structs.replace(
        last, first_seq=seq + i, records=[msgspec.structs.replace(quiet, ts=ts)]))
        for i, ts in enumerate([float("inf"), float("-inf"), float("nan")])]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Any]]:
    frames = real_frames()
    side = ServeProcess(tmp_path_factory.mktemp("http"),
                        args=["--clickhouse-dsn", "off", "--log-level", "warning",
                              "--layout-interval", "0.2"])
    try:
        side.start()
        push(side.endpoint, [wire.encode(f) for f in frames[:-1]])
        # Every frame taken before the poison goes out on a second connection: the
        # receiver's PULL socket takes turns between connections, and a frame of the first
        # read after the poison would be refused as a replay (its records come before
        # the poison's), not accepted.
        wait_until("every frame taken", lambda: side.value(
            "kvscope_probe_frames_received_total") == len(frames) - 1, 30)
        assert side.engines()[0]["synced"]
        push(side.endpoint, poison(frames[:-1]))
        wait_until("the poison frames to be refused",
                   lambda: side.value("kvscope_probe_frames_rejected_total",
                                      reason="invalid") == 3, 30)
        time.sleep(0.5)  # a layout sample or two
        yield side, frames
    finally:
        side.stop()


def test_the_receiver_survives_poison_frames(served: tuple[ServeProcess, Any]) -> None:
    side, frames = served
    assert side.get("/healthz").json()["status"] in ("ok", "probe silent")
    # it still takes records, and a keyframe puts the engine back in sync
    before = side.value("kvscope_probe_records_received_total") or 0
    kf = [f for f in frames if any(isinstance(r, wire.Keyframe) for r in f.records)][-1]
    last = frames[-2]  # the session's last frame before the three poison frames
    after = last.first_seq + len(last.records) + 3  # a keyframe sent after them, not a replay
    push(side.endpoint, [wire.encode(msgspec.structs.replace(kf, first_seq=after))])
    wait_until("a record after the poison", lambda: (
        side.value("kvscope_probe_records_received_total") or 0) > before, 10)
    wait_until("the engine to be synced again", lambda: side.engines()[0]["synced"], 10)
    assert "receiver stopped" not in side.get("/healthz").text


def test_every_route_fuzzed_from_the_openapi_document_answers_without_5xx(
        served: tuple[ServeProcess, Any]) -> None:
    side, _ = served
    doc = side.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    counts: dict[str, int] = {}
    failures: list[str] = []
    client = httpx.Client(base_url=side.url, timeout=30.0, trust_env=False)
    operations = [r.ok() for r in schema.get_all_operations()]

    def send(case: Any, label: str) -> None:
        kw = case.as_transport_kwargs(base_url=side.url)
        r = client.request(kw["method"], kw["url"], params=kw.get("params"),
                           headers={k: v for k, v in (kw.get("headers") or {}).items()
                                    if k.lower() != "user-agent"} or None)
        key = f"{label} {r.status_code}"
        counts[key] = counts.get(key, 0) + 1
        if r.status_code >= 500:
            failures.append(f"{kw['method']} {kw['url']} {kw.get('params')} -> "
                            f"{r.status_code} {r.text[:200]}")

    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{op.method.upper()} {op.path} {mode.value}"
            run = settings(max_examples=EXAMPLES, deadline=None, database=None,
                           derandomize=True, suppress_health_check=list(HealthCheck))(
                given(case=op.as_strategy(generation_mode=mode))(sender_for(send, label)))
            try:
                run()
            except Unsatisfiable:  # no parameter to make invalid
                assert mode == GenerationMode.NEGATIVE and not doc["paths"][op.path]["get"].get(
                    "parameters"), label
    hostile = hand_made(client)
    client.close()
    total = sum(counts.values())
    print(f"\nproperty 5b: {len(operations)} operations from /openapi.json "
          f"({', '.join(sorted(doc['paths']))}), {total} schemathesis requests, "
          f"{len(hostile)} hand-made hostile requests; statuses "
          f"{summarise(counts, hostile)}")
    assert not failures, failures[:10]
    assert all(code < 500 for code in hostile.values()), {
        k: v for k, v in hostile.items() if v >= 500}
    assert len(operations) == len(doc["paths"]) >= 7 and total >= len(operations) * 100
    assert side.alive()


def sender_for(send: Any, label: str) -> Any:
    def check(case: Any) -> None:
        send(case, label)

    return check


def summarise(counts: dict[str, int], hostile: dict[str, int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for key, n in counts.items():
        code = int(key.rsplit(" ", 1)[1])
        out[code] = out.get(code, 0) + n
    for code in hostile.values():
        out[code] = out.get(code, 0) + 1
    return dict(sorted(out.items()))


def raw(port: int, request: bytes) -> int:
    """Send bytes as they are; the status code of the answer (0: the server hung up)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                return 0
            data += chunk
    return int(data.split(b" ", 2)[1])


def hand_made(client: httpx.Client) -> dict[str, int]:
    """Requests no schema describes: methods, paths, encodings, sizes."""
    out: dict[str, int] = {}
    port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
    paths = ["/metrics", "/healthz", "/api/engines", "/api/layout", "/api/layout/history",
             "/health/preempt-rate", "/ui", "/openapi.json", "/docs", "/redoc"]
    for path in paths:
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"):
            out[f"{method} {path}"] = client.request(method, path).status_code
    queries = {"engine": "\x00\u202e" * 50, "since": "9" * 400, "until": "-1e309",
               "window": "nan", "max_runs": "99999999999999999999999", "limit": "-0",
               "history_points": "1e3", "token": "x" * 5000}
    for path in paths:
        out[f"GET {path} hostile query"] = client.get(path, params=queries).status_code
        out[f"GET {path} repeated"] = client.get(
            path, params=[("engine", "a"), ("engine", "b"), ("since", "now")]).status_code
    for name, req in {
        "nul in path": b"GET /api/%00engines HTTP/1.1\r\nHost: x\r\n\r\n",
        "dot segments": b"GET /healthz/../metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        "bad percent": b"GET /api/layout?engine=%zz%ff HTTP/1.1\r\nHost: x\r\n\r\n",
        "long path": b"GET /" + b"a" * 60_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "long header": b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: " + b"b" * 60_000
                       + b"\r\n\r\n",
        "latin-1 header": b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe"
                          b"\r\n\r\n",
        "bad content-length": b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 1x"
                              b"\r\n\r\n",
        "http/1.0 no host": b"GET /api/engines HTTP/1.0\r\n\r\n",
    }.items():
        out[f"raw {name}"] = raw(port, req)
    return out


def test_oversized_bodies_get_413(served: tuple[ServeProcess, Any]) -> None:
    side, _ = served
    big = b"x" * (MAX_BODY_BYTES + 1)
    with httpx.Client(base_url=side.url, timeout=30.0, trust_env=False) as c:
        assert c.post("/metrics", content=big).status_code == 413  # Content-Length
        assert c.put("/api/engines", content=big).status_code == 413

        def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
            for _ in range(40):
                yield b"y" * 65536

        assert c.post("/api/engines", content=chunks()).status_code == 413
        # within the limit the route answers as it always did (no POST route: 405)
        assert c.post("/metrics", content=b"x" * MAX_BODY_BYTES).status_code == 405
        assert c.post("/metrics", content=iter([b"x" * 1000])).status_code == 405
    # a claimed 10 GiB body is refused at once, without waiting for any of it
    t0 = time.monotonic()
    code = raw(side.port, b"POST /api/engines HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 10737418240\r\n\r\n")
    took = time.monotonic() - t0
    print(f"\nproperty 5c: bodies over {MAX_BODY_BYTES} bytes -> 413 (declared, chunked, "
          f"and a 10 GiB claim answered in {took * 1000:.0f} ms)")
    assert code == 413 and took < 5
    assert side.get("/metrics").status_code == 200


def stand_in() -> FastAPI:
    """Stands in for vLLM's OpenAI routes behind the middleware."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        await request.body()
        return {"id": f"cmpl-{request.headers.get('x-request-id')}"}

    return app


HOSTILE = ['a",engine="x', "}\\", "\u202eevil", "\x7f" * 10, "other", "", " ",
           "x" * 10_000, "é" * 200, "{{7*7}}", "'; DROP TABLE kvscope.client_requests; --"]
"""Each is sent with a distinct prefix, so every value asks for a label of its own."""


def test_hostile_client_headers_cannot_raise_metric_cardinality(
        served: tuple[ServeProcess, Any]) -> None:
    side, _ = served
    app = stand_in()
    app.add_middleware(KVScopeMiddleware, endpoint=side.endpoint)
    join = ClientJoin(lambda _row: None, keyer=Keyer(b"caps-only-test-secret"))
    caps = {"client": join.stats.clients.limit, "user_agent": join.stats.agents.limit}
    n = 600
    with TestClient(app) as client:
        for i in range(n):
            hostile = f"{i}-{HOSTILE[i % len(HOSTILE)]}"
            headers = {"X-Client-Id": hostile.encode(),
                       "User-Agent": f"ua/{i} {hostile}".encode(),
                       "Authorization": f"Bearer sk-{i}".encode()}
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                            headers=headers)
            assert r.status_code == 200

    def total() -> float:
        m = side.metrics()
        return sum(v for (name, _), v in m.items() if name == "kvscope_client_requests_total")

    wait_until(f"{n} client requests in /metrics", lambda: total() >= n, 30)
    text = side.get("/metrics").text
    m = side.metrics()  # parses: no label value broke the exposition format
    clients = {dict(k)["client"] for name, k in m if name == "kvscope_client_requests_total"}
    agents = {dict(k)["user_agent"] for name, k in m
              if name == "kvscope_user_agent_requests_total"}
    over = {lbl: m[("kvscope_client_label_overflow_total", frozenset({"label": lbl}.items()))]
            for lbl in caps}
    series = sum(1 for line in text.splitlines() if line.startswith("kvscope_client_"))
    print(f"\nproperty 5d: {n} requests with distinct hostile client-id / user-agent values "
          f"-> {len(clients)} client labels (cap {caps['client']} + other), {len(agents)} "
          f"user-agent labels (cap {caps['user_agent']} + other), overflow counted {over}, "
          f"{series} kvscope_client_* series in all")
    assert len(clients) <= caps["client"] + 1 and "other" in clients
    assert len(agents) <= caps["user_agent"] + 1 and "other" in agents
    assert total() == n
    assert over["client"] == n - caps["client"] and over["user_agent"] == n - caps["user_agent"]
    assert all(len(v) <= 64 and v.isprintable() for v in clients | agents)
