"""The vLLM API-server middleware, in front of a small ASGI app, sending real frames."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvscope.sidecar.ingest.receiver import Receiver
from kvscope.state.hub import Hub
from kvscope_probe import wire
from kvscope_probe.middleware import (
    MAX_REQUEST_ID,
    KVScopeMiddleware,
    prompt_digest,
    request_key,
)

SECRET_PROMPT = "canary-7f3e the quick brown fox"


def echo_app() -> FastAPI:
    """Stands in for vLLM's OpenAI routes: picks the request ID the way vLLM 0.32's
    ``_base_request_id`` does (the first X-Request-Id header, else the body's) and
    answers with it."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, object]:
        body = await request.json()
        rid = request.headers.get("x-request-id", body.get("request_id"))
        return {"id": f"cmpl-{rid}", "n": len(body["prompt"])}

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


class Listening:
    """A real receiver and hub on an ipc endpoint, collecting the client records."""

    def __init__(self, tmp_path: Path) -> None:
        self.endpoint = f"ipc://{tmp_path}/p.sock"
        self.hub = Hub()
        self.got = collect(self.hub)
        self.rx = Receiver(self.hub, [self.endpoint])
        self.clients: list[TestClient] = []

    def __enter__(self) -> Listening:
        self.rx.bind()
        self.rx.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        for client in self.clients:  # the app's lifespan ends: each emitter closes
            client.__exit__(None, None, None)
        self.rx.stop()

    def client(self) -> TestClient:
        """A client of the app behind the middleware, its lifespan started (and ended
        when this ends)."""
        app = echo_app()
        app.add_middleware(KVScopeMiddleware, endpoint=self.endpoint)
        client = TestClient(app).__enter__()
        self.clients.append(client)
        return client

    def calls(self, n: int) -> list[tuple[wire.ClientStart, wire.ClientEnd]]:
        """The first ``n`` calls, each start with the end that shares its call_id."""
        wait_for(self.got, 2 * n)
        ends = {g.call_id: g for g in self.got if isinstance(g, wire.ClientEnd)}
        return [(s, ends[s.call_id]) for s in self.got if isinstance(s, wire.ClientStart)][:n]


def test_requests_are_tagged_and_reported_without_prompt_text(tmp_path: Path) -> None:
    with Listening(tmp_path) as listening:
        client = listening.client()
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": SECRET_PROMPT,
                                                 "max_tokens": 8},
                        headers={"X-Client-Id": "team-a", "User-Agent": "pytest/1",
                                 "Authorization": "Bearer sk-123"})
        assert r.status_code == 200 and r.json()["n"] == len(SECRET_PROMPT)
        rid = r.json()["id"].removeprefix("cmpl-")  # nobody chose one: the middleware did
        assert rid.startswith("kvs") and len(rid) == 35
        client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                "content": SECRET_PROMPT}]})
        (s, e), (chat, _) = listening.calls(2)
        assert (s.request_id, s.call_id, s.client_id, s.user_agent, s.max_tokens) == (
            rid, rid, "team-a", "pytest/1", 8)
        assert s.prompt_sha256 == prompt_digest("completions", {"prompt": SECRET_PROMPT})[0]
        assert s.api_key_sha256 == hashlib.sha256(b"sk-123").hexdigest()
        assert chat.endpoint == "chat" and chat.request_id.startswith("kvs")
        assert e.status == 200 and e.duration_s >= 0 and e.request_id == rid
        assert SECRET_PROMPT not in repr(listening.got) and "sk-123" not in repr(listening.got)


def test_a_prompt_that_is_no_utf8_is_hashed_and_never_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """JSON may carry a lone surrogate (\\ud800), which json.loads accepts and a strict
    UTF-8 encode refuses: the digest failed, and the contained error's repr, logged once,
    held the whole prompt. A model name or request ID of the kind failed the emitter's
    whole batch of up to 256 events."""
    body = ('{"model": "tiny\\udc80", "prompt": "' + SECRET_PROMPT
            + ' \\ud800", "max_tokens": 4}').encode()
    with Listening(tmp_path) as listening, caplog.at_level(logging.DEBUG):
        client = listening.client()
        r = client.post("/v1/completions", content=body,
                        headers={"content-type": "application/json"})
        assert r.status_code == 200
        client.post("/v1/completions", json={"model": "tiny", "prompt": "next"})
        assert SECRET_PROMPT not in caplog.text
        (odd, _), (nxt, _) = listening.calls(2)
    assert odd.prompt_sha256 and odd.prompt_chars == len(SECRET_PROMPT) + 4
    assert odd.model == "tiny?" and nxt.model == "tiny"
    assert request_key("r\ud800").startswith("sha256:")  # sendable, and still one key
    assert middleware_of(client.app).errors == 0  # type: ignore[arg-type]


def test_an_error_after_the_answer_began_ends_the_call_once_with_its_status(
        tmp_path: Path) -> None:
    """An app that fails after its last body (the call had ended: it was reported again,
    as 500) or in the middle of a streamed body once its 200 went out (reported as 500,
    which the caller never got)."""

    async def failing(scope: dict[str, object], receive: object, send: object) -> None:
        assert callable(receive) and callable(send)
        if scope["type"] == "lifespan":  # the middleware's emitter lives with the app
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        last = scope["path"] == "/v1/completions"
        await send({"type": "http.response.body", "body": b"{}", "more_body": not last})
        raise RuntimeError("after the answer began")

    with Listening(tmp_path) as listening:
        app = KVScopeMiddleware(failing, endpoint=listening.endpoint)
        with TestClient(app, raise_server_exceptions=False) as client:  # type: ignore[arg-type]
            for path in ("/v1/completions", "/v1/chat/completions"):
                client.post(path, json={"prompt": "x", "messages": []})
            wait_for(listening.got, 4)
            time.sleep(0.3)  # a second end, had one been sent, arrives with these
    ends = [g for g in listening.got if isinstance(g, wire.ClientEnd)]
    assert sorted(e.status for e in ends) == [200, 200]


def test_a_callers_request_id_is_kept_as_vllm_would_read_it(tmp_path: Path) -> None:
    """The header as sent (first one wins, empty counts), else the body's request_id;
    never replaced. An oversized one is reported by its digest. (Latin-1 bytes need a
    real server: the test client re-encodes headers; tests/engine sends them.)"""
    huge = "r" * (MAX_REQUEST_ID + 1)
    cases = [
        ([(b"x-request-id", b"team-a/req 1")], {}, "team-a/req 1"),
        ([(b"X-Request-Id", b"first"), (b"x-request-id", b"second")], {}, "first"),
        ([(b"x-request-id", b'odd;q="2" \t{}')], {}, 'odd;q="2" \t{}'),
        ([(b"x-request-id", b"")], {}, ""),
        ([], {"request_id": "from-the-body"}, "from-the-body"),
        ([(b"x-request-id", b"header")], {"request_id": "body"}, "header"),
        ([(b"x-request-id", huge.encode())], {}, huge),
    ]
    with Listening(tmp_path) as listening:
        client = listening.client()
        for headers, extra, want in cases:
            r = client.post("/v1/completions", headers=headers,
                            json={"model": "tiny", "prompt": "w1 w2", **extra})
            assert r.status_code == 200 and r.json()["id"] == f"cmpl-{want}"
        calls = listening.calls(len(cases))
    for (s, e), (_, _, want) in zip(calls, cases, strict=True):
        assert s.request_id == (want if len(want) <= MAX_REQUEST_ID else
                                "sha256:" + hashlib.sha256(want.encode()).hexdigest())
        assert e.request_id == s.request_id and e.call_id == s.call_id
    assert len({s.call_id for s, _ in calls}) == len(cases)  # unique even when IDs repeat


def test_one_request_id_sent_twice_gets_two_calls(tmp_path: Path) -> None:
    with Listening(tmp_path) as listening:
        client = listening.client()
        for status_prompt in ("a", "b"):
            client.post("/v1/completions", headers={"X-Request-Id": "retry-1"},
                        json={"prompt": status_prompt})
        (s1, e1), (s2, e2) = listening.calls(2)
    assert s1.request_id == s2.request_id == "retry-1"
    assert s1.call_id != s2.call_id and (e1.call_id, e2.call_id) == (s1.call_id, s2.call_id)


def test_a_dead_sidecar_or_odd_body_never_fails_a_request(tmp_path: Path) -> None:
    app = echo_app()
    app.add_middleware(KVScopeMiddleware, endpoint=f"ipc://{tmp_path}/nobody.sock")
    with TestClient(app, raise_server_exceptions=False) as client:
        dead_sidecar_requests(client)
    emitter = middleware_of(app).emitter
    assert emitter is not None and emitter._thread is not None
    # The shutdown ends it, sidecar or not: within its connection grace (1 s) and the
    # close's bound (1 s) of the shutdown; it may still wait out the grace when told.
    emitter._thread.join(5.0)
    assert not emitter._thread.is_alive()
    assert (emitter.sent, emitter.dropped) == (0, 100)  # every event counted


def dead_sidecar_requests(client: TestClient) -> None:
    bare = TestClient(echo_app(), raise_server_exceptions=False)
    for _ in range(50):
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    odd = {"content": b"not json", "headers": {"content-type": "application/json"}}
    # the app's own answer to a bad body, untouched by kvscope
    assert (client.post("/v1/completions", **odd).status_code
            == bare.post("/v1/completions", **odd).status_code)
    assert client.get("/docs").status_code == 200


def middleware_of(app: FastAPI) -> KVScopeMiddleware:
    """The middleware instance Starlette built for ``app`` (after its first call)."""
    layer = app.middleware_stack
    while not isinstance(layer, KVScopeMiddleware):
        layer = layer.app  # type: ignore[union-attr]
    return layer


def test_at_shutdown_the_emitter_sends_what_it_holds_and_ends(tmp_path: Path) -> None:
    """The server's lifespan shutdown closes the middleware's emitter: the events of the
    last requests reach the sidecar, and its thread ends (it reconnected for ever
    before, in the API server and in every test that made one)."""
    with Listening(tmp_path) as listening:
        app = echo_app()
        app.add_middleware(KVScopeMiddleware, endpoint=listening.endpoint)
        with TestClient(app) as client:
            for i in range(20):
                assert client.post("/v1/completions", json={"prompt": f"p{i}"}).status_code == 200
            emitter = middleware_of(app).emitter
            assert emitter is not None and emitter._thread is not None
            thread = emitter._thread
            assert thread.is_alive()
        assert not thread.is_alive()
        assert (emitter.sent, emitter.dropped) == (40, 0)
        wait_for(listening.got, 40)
        assert len(listening.got) == 40


def test_a_closed_emitter_counts_what_it_could_not_send(tmp_path: Path) -> None:
    from kvscope_probe.emitter import Emitter

    start = wire.ClientStart(request_id="r", ts=1.0, endpoint="completions", model="m",
                             client_id="", user_agent="", api_key_sha256="", prompt_sha256="h",
                             prompt_chars=1, max_tokens=1)
    idle = Emitter(f"ipc://{tmp_path}/nobody.sock")
    idle.close()  # before any event: no thread was started, none is now
    idle.emit(start)
    assert idle._thread is None and (idle.sent, idle.dropped, len(idle.queue)) == (0, 1, 0)
    with Listening(tmp_path) as listening:
        em = Emitter(listening.endpoint)
        for _ in range(3):
            em.emit(start)
        em.close()
        em.close()  # twice: nothing more
        assert em._thread is not None and not em._thread.is_alive()
        em.emit(start)  # after close: dropped and counted, no thread started again
        assert (em.sent, em.dropped, len(em.queue)) == (3, 1, 0)
        wait_for(listening.got, 3)
        assert len(listening.got) == 3


def test_the_output_limit_is_the_one_vllm_takes() -> None:
    """A chat request with both limits: vLLM takes max_completion_tokens (the middleware
    reported max_tokens); a completion's max_completion_tokens is not a field vLLM reads."""
    from kvscope_probe.middleware import max_tokens_of

    both = {"max_tokens": 100, "max_completion_tokens": 20}
    assert max_tokens_of("chat", both) == 20
    assert max_tokens_of("chat", {"max_tokens": 100}) == 100
    assert max_tokens_of("chat", {"max_completion_tokens": None, "max_tokens": 7}) == 7
    assert max_tokens_of("completions", both) == 100
    assert max_tokens_of("completions", {"max_completion_tokens": 20}) == -1
    assert max_tokens_of("chat", {"max_tokens": True}) == -1
    assert max_tokens_of("chat", {}) == -1
