"""ASGI middleware for vLLM's OpenAI server: who sent each request, joined to its trace.

Enable it with vLLM's own option and the probe's endpoint::

    KVSCOPE_PROBE_ENDPOINT=ipc:///run/kvscope/probe.sock \\
    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware kvscope_probe.middleware.KVScopeMiddleware

For ``POST /v1/completions`` and ``/v1/chat/completions`` it reads the User-Agent, a
client-id header (``KVSCOPE_CLIENT_ID_HEADER``, default ``x-client-id``) and a hash of the
bearer API key; hashes the prompt (the text is never stored or sent); sets
``X-Request-Id`` to a fresh ``kvs<32 hex>`` so the engine's request IDs embed it (vLLM
0.32 forms ``cmpl-<id>-<i>-<8 hex>`` and ``chatcmpl-<id>-<8 hex>``); and sends a start and
an end event to the sidecar. A request whose body cannot be read as JSON, or any error of
kvscope's own, passes through untouched: kvscope being down never fails a request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from typing import Any

from kvscope_probe import wire
from kvscope_probe.emitter import Emitter

log = logging.getLogger("kvscope.middleware")

PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
MAX_BODY = 16 << 20  # larger bodies pass through unhashed
ENV_HEADER = "KVSCOPE_CLIENT_ID_HEADER"


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def prompt_fingerprint(endpoint: str, body: dict[str, Any]) -> tuple[str, int]:
    """(hash, length in characters of its canonical form) of the prompt or messages."""
    if endpoint == "chat":
        msgs = body.get("messages") or []
        part: Any = [[m.get("role"), m.get("content")] for m in msgs if isinstance(m, dict)]
    else:
        part = body.get("prompt")
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return _hash(text.encode()), len(text)


class KVScopeMiddleware:
    """Pure ASGI middleware (vLLM adds a class with ``app.add_middleware``)."""

    def __init__(self, app: Any, endpoint: str | None = None,
                 client_id_header: str | None = None) -> None:
        self.app = app
        ep = endpoint or os.environ.get("KVSCOPE_PROBE_ENDPOINT")
        self.emitter = Emitter(ep) if ep else None
        self.header = (client_id_header or os.environ.get(ENV_HEADER)
                       or "x-client-id").lower().encode()
        self.errors = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        endpoint = PATHS.get(scope.get("path", "")) if scope.get("type") == "http" else None
        if endpoint is None or scope.get("method") != "POST" or self.emitter is None:
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        messages = []
        while more:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > MAX_BODY:
                break
        replay = iter(messages)

        async def replay_receive() -> Any:
            nxt = next(replay, None)
            return nxt if nxt is not None else await receive()

        rid, started = self._start(scope, endpoint, body, more)
        if rid is None:
            await self.app(scope, replay_receive, send)
            return
        status = {"code": 500}

        async def observed_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message.get("status", 0))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self._end(rid, status["code"], started)

        try:
            await self.app(scope, replay_receive, observed_send)
        except BaseException:
            self._end(rid, 500, started)
            raise

    def _start(self, scope: dict[str, Any], endpoint: str, body: bytes,
               truncated: bool) -> tuple[str | None, float]:
        started = time.perf_counter()
        try:
            if truncated:
                return None, started
            data = json.loads(body or b"{}")
            if not isinstance(data, dict):
                return None, started
            headers = dict(scope.get("headers") or [])
            rid = f"kvs{uuid.uuid4().hex}"
            scope["headers"] = [(k, v) for k, v in scope.get("headers") or []
                                if k.lower() != b"x-request-id"] + [(b"x-request-id", rid.encode())]
            auth = headers.get(b"authorization", b"")
            key = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            phash, plen = prompt_fingerprint(endpoint, data)
            max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
            assert self.emitter is not None
            self.emitter.emit(wire.ClientStart(
                request_id=rid, ts=time.time(), endpoint=endpoint,
                model=str(data.get("model", ""))[:128],
                client_id=headers.get(self.header, b"").decode(errors="replace")[:128],
                user_agent=headers.get(b"user-agent", b"").decode(errors="replace")[:200],
                api_key_hash=_hash(key) if key else "",
                prompt_hash=phash, prompt_chars=plen,
                max_tokens=int(max_tokens) if isinstance(max_tokens, int) else -1))
            return rid, started
        except Exception as exc:  # noqa: BLE001 - never fail a request over kvscope
            self._error(exc)
            return None, started

    def _end(self, rid: str, status: int, started: float) -> None:
        try:
            assert self.emitter is not None
            self.emitter.emit(wire.ClientEnd(rid, time.time(), status,
                                             time.perf_counter() - started))
        except Exception as exc:  # noqa: BLE001
            self._error(exc)

    def _error(self, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("kvscope middleware: contained an error: %r", exc)
