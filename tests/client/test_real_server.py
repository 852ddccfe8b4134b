"""The real transport path: uvicorn serving FastAPI on 127.0.0.1, real sockets, real time.

The app answers each client's first completion with ``429 Retry-After: 1`` and its second
with a 200, and mounts the real kvscope sidecar app (empty hub, token-guarded) so the SDK
reads a real ``/health/preempt-rate``. Each test takes about one second: the Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from kvscope.client import AsyncKVScopeClient, ClientConfig, KVScopeClient
from kvscope.sidecar.http.app import create_app
from kvscope.state.hub import Hub

Seen = dict[str, list[tuple[float, dict[str, str]]]]


def vllm_like_app(seen: Seen) -> FastAPI:
    """``POST /v1/completions`` shaped like vLLM's answer; 429 first, per client id."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        client = request.headers.get("x-client-id", "")
        seen[client].append((time.monotonic(), dict(request.headers)))
        body = await request.json()
        if len(seen[client]) == 1:
            return JSONResponse({"error": {"message": "busy"}}, status_code=429,
                                headers={"Retry-After": "1"})
        return JSONResponse({"id": "cmpl-1", "object": "text_completion",
                             "model": body["model"],
                             "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})

    sidecar = create_app(Hub(), CollectorRegistry(), health_timeout_s=30.0, token="t0k")
    app.mount("/sidecar", sidecar)
    return app


@contextlib.contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread on a free loopback port until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15.0
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15.0)
        sock.close()


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, Seen]]:
    seen: Seen = defaultdict(list)
    with serve(vllm_like_app(seen)) as url:
        yield url, seen


def client_kw(url: str, client_id: str) -> dict[str, Any]:
    return {"base_url": url, "client_id": client_id, "api_key": "sk-real",
            "preempt_rate_url": url + "/sidecar/health/preempt-rate", "sidecar_token": "t0k",
            "config": ClientConfig(request_timeout_s=10.0)}


def check(seen: Seen, client_id: str, answer: dict[str, Any], state: Any) -> None:
    assert answer["choices"][0]["text"] == "hi"
    (t1, first), (t2, second) = seen[client_id]
    assert t2 - t1 >= 0.95, "the retry must wait for Retry-After: 1"
    assert second["x-client-id"] == client_id
    assert second["user-agent"] == "kvscope-client/0.1.0"
    assert second["authorization"] == "Bearer sk-real"
    assert state.retries_total == 1 and state.window.counts["overloaded"] == 1
    assert state.server is not None and state.server.recommendation == "ok"  # token accepted


def test_sync_client_over_real_sockets(live: tuple[str, Seen]) -> None:
    url, seen = live
    with KVScopeClient(**client_kw(url, "real-sync")) as c:
        answer = c.completions(model="tiny", prompt="hello", max_tokens=2)
        check(seen, "real-sync", answer, c.state())


def test_async_client_over_real_sockets(live: tuple[str, Seen]) -> None:
    url, seen = live

    async def main() -> tuple[dict[str, Any], Any]:
        async with AsyncKVScopeClient(**client_kw(url, "real-async")) as c:
            return await c.completions(model="tiny", prompt="hello"), c.state()

    answer, state = asyncio.run(main())
    check(seen, "real-async", answer, state)
