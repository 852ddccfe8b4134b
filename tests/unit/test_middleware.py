"""The vLLM API-server middleware, in front of a small ASGI app, sending real frames."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvscope.sidecar.hub import Hub
from kvscope.sidecar.receiver import Receiver
from kvscope_probe import wire
from kvscope_probe.middleware import KVScopeMiddleware

SECRET_PROMPT = "canary-7f3e the quick brown fox"


def echo_app() -> FastAPI:
    """Stands in for vLLM's OpenAI routes: answers with the request ID it was given."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, object]:
        body = await request.json()
        return {"id": f"cmpl-{request.headers.get('x-request-id')}", "n": len(body["prompt"])}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, object]:
        await request.body()
        return {"id": f"chatcmpl-{request.headers.get('x-request-id')}"}

    return app


def collect(hub: Hub) -> list[wire.Record]:
    got: list[wire.Record] = []
    hub.client_listeners.append(got.append)
    return got


def wait_for(got: list[wire.Record], n: int) -> None:
    deadline = time.monotonic() + 5
    while len(got) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def test_requests_are_tagged_and_reported_without_prompt_text(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/p.sock"
    hub = Hub()
    got = collect(hub)
    rx = Receiver(hub, [endpoint])
    rx.bind()
    rx.start()
    try:
        app = echo_app()
        app.add_middleware(KVScopeMiddleware, endpoint=endpoint)
        client = TestClient(app)
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": SECRET_PROMPT,
                                                 "max_tokens": 8},
                        headers={"X-Request-Id": "client-chosen", "X-Client-Id": "team-a",
                                 "User-Agent": "pytest/1", "Authorization": "Bearer sk-123"})
        assert r.status_code == 200 and r.json()["n"] == len(SECRET_PROMPT)
        rid = r.json()["id"].removeprefix("cmpl-")
        assert rid.startswith("kvs") and len(rid) == 35
        client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                "content": SECRET_PROMPT}]})
        wait_for(got, 4)
        starts = [g for g in got if isinstance(g, wire.ClientStart)]
        ends = [g for g in got if isinstance(g, wire.ClientEnd)]
        assert len(starts) == 2 and len(ends) == 2
        s = starts[0]
        assert (s.request_id, s.client_id, s.user_agent, s.max_tokens) == (
            rid, "team-a", "pytest/1", 8)
        assert len(s.prompt_hash) == 16 and s.api_key_hash and "sk-123" not in repr(s)
        assert ends[0].status == 200 and ends[0].duration_s >= 0
        assert SECRET_PROMPT not in repr(got)
    finally:
        rx.stop()


def test_a_dead_sidecar_or_odd_body_never_fails_a_request(tmp_path: Path) -> None:
    app = echo_app()
    app.add_middleware(KVScopeMiddleware, endpoint=f"ipc://{tmp_path}/nobody.sock")
    client = TestClient(app, raise_server_exceptions=False)
    bare = TestClient(echo_app(), raise_server_exceptions=False)
    for _ in range(50):
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    odd = {"content": b"not json", "headers": {"content-type": "application/json"}}
    # the app's own answer to a bad body, untouched by kvscope
    assert (client.post("/v1/completions", **odd).status_code
            == bare.post("/v1/completions", **odd).status_code)
    assert client.get("/docs").status_code == 200
