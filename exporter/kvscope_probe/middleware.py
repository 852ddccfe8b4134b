"""ASGI middleware for vLLM's OpenAI server: who sent each request, joined to its trace.

Enable it with vLLM's own option and the probe's endpoint::

    KVSCOPE_PROBE_ENDPOINT=ipc:///run/kvscope/probe.sock \\
    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware kvscope_probe.middleware.KVScopeMiddleware

For ``POST /v1/completions`` and ``/v1/chat/completions`` it reads the User-Agent, a
client-id header (``KVSCOPE_CLIENT_ID_HEADER``, default ``x-client-id``), a digest of the
bearer API key and a digest of the prompt (the text is never stored or sent; the sidecar
keys both digests before it keeps anything), and sends a start and an end event to the
sidecar. A request whose body cannot be read as JSON, or any error of kvscope's own,
passes through untouched: kvscope being down never fails a request. When the server shuts
down (the ASGI lifespan's ``lifespan.shutdown``) the events still queued are sent, within a
second, and the emitter's socket and thread end.

The request's ID is the caller's. vLLM 0.32 takes the first ``X-Request-Id`` header as it
is (Starlette decodes it as latin-1; an empty value counts), else the body's
``request_id``; only when neither is there does the middleware set ``X-Request-Id:
kvs<32 hex>``. vLLM then forms engine request IDs ``cmpl-<id>-<i>-<8 hex>`` (completions;
i = prompt index) and ``chatcmpl-<id>-<8 hex>`` (chat), ``<k>_`` in front for each of n > 1
samples, which is what the sidecar parses back (``kvscope.sidecar.clients``).
"""

from __future__ import annotations

import asyncio
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
MAX_REQUEST_ID = 128
"""Longer caller IDs are joined on their digest (``request_key``)."""
ENV_HEADER = "KVSCOPE_CLIENT_ID_HEADER"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def request_key(request_id: str) -> str:
    """The bounded form of a request ID that start events carry and joins use: its
    SHA-256 when it is long, or holds what UTF-8 cannot encode (a lone surrogate from a
    JSON body), which would fail the whole batch it is sent in."""
    if len(request_id) <= MAX_REQUEST_ID and _utf8(request_id):
        return request_id
    return "sha256:" + sha256_hex(request_id.encode("utf-8", "surrogatepass"))


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _sendable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode replaced (``?``)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def max_tokens_of(endpoint: str, body: dict[str, Any]) -> int:
    """The output limit vLLM takes from the body: a chat request's
    ``max_completion_tokens`` before its deprecated ``max_tokens`` (0.32
    ``chat_completion/serving.py`` 344), a completion's ``max_tokens`` (the only one it
    reads); -1 when none is given as an integer."""
    value = body.get("max_completion_tokens") if endpoint == "chat" else None
    if value is None:
        value = body.get("max_tokens")
    return value if type(value) is int else -1


def prompt_digest(endpoint: str, body: dict[str, Any]) -> tuple[str, int]:
    """(SHA-256 hex, length in characters) of the canonical form of the prompt or messages."""
    if endpoint == "chat":
        msgs = body.get("messages") or []
        part: Any = [[m.get("role"), m.get("content")] for m in msgs if isinstance(m, dict)]
    else:
        part = body.get("prompt")
    text = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: JSON may carry a lone surrogate, which a strict encode refuses
    return sha256_hex(text.encode("utf-8", "surrogatepass")), len(text)


def caller_request_id(headers: list[tuple[bytes, bytes]], body: dict[str, Any]) -> str | None:
    """The ID vLLM will use for this request, as vLLM 0.32 picks it; None: none chosen."""
    for name, value in headers:
        if name.lower() == b"x-request-id":
            return value.decode("latin-1")
    rid = body.get("request_id")
    return rid if isinstance(rid, str) else None


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
        if scope.get("type") == "lifespan" and self.emitter is not None:
            await self.app(scope, self._closing_at_shutdown(receive), send)
            return
        endpoint = PATHS.get(scope.get("path", "")) if scope.get("type") == "http" else None
        if endpoint is None or scope.get("method") != "POST" or self.emitter is None:
            await self.app(scope, receive, send)
            return
        more, size = True, 0
        messages, chunks = [], []
        while more:  # the chunks joined once: `body += chunk` copies the body each time
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            chunk = msg.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = msg.get("more_body", False)
            if size > MAX_BODY:
                break
        body = b"".join(chunks)
        replay = iter(messages)

        async def replay_receive() -> Any:
            nxt = next(replay, None)
            return nxt if nxt is not None else await receive()

        call = self._start(scope, endpoint, body, more)
        if call is None:
            await self.app(scope, replay_receive, send)
            return
        # the status the caller was sent (500 until a response starts: an error before it
        # is answered 500 by the server's error handler), and whether the end was reported
        status = {"code": 500, "ended": 0}

        async def observed_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message.get("status", 0))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                status["ended"] = 1
                self._end(call, status["code"])

        try:
            await self.app(scope, replay_receive, observed_send)
        except BaseException:
            # once: an error after the last body (or a cancelled stream after its status
            # went out) ends the call with the status the caller got, not a second 500
            if not status["ended"]:
                self._end(call, status["code"])
            raise

    def _closing_at_shutdown(self, receive: Any) -> Any:
        """``receive`` for the lifespan: once the server says it shuts down, the emitter
        sends what it holds and closes (off the event loop), before the app hears it."""
        emitter = self.emitter

        async def lifespan_receive() -> Any:
            msg = await receive()
            if msg.get("type") == "lifespan.shutdown" and emitter is not None:
                try:
                    await asyncio.to_thread(emitter.close)
                except Exception as exc:  # noqa: BLE001 - never fail a shutdown over kvscope
                    self._error(exc)
            return msg

        return lifespan_receive

    def _start(self, scope: dict[str, Any], endpoint: str, body: bytes,
               truncated: bool) -> _Call | None:
        started = time.perf_counter()
        try:
            if truncated:
                return None
            data = json.loads(body or b"{}")
            if not isinstance(data, dict):
                return None
            raw_headers = list(scope.get("headers") or [])
            headers = {k.lower(): v for k, v in reversed(raw_headers)}  # first one wins
            call_id = f"kvs{uuid.uuid4().hex}"
            rid = caller_request_id(raw_headers, data)
            if rid is None:  # nobody chose one: vLLM would draw a random one we cannot see
                rid = call_id
                scope["headers"] = raw_headers + [(b"x-request-id", rid.encode())]
            auth = headers.get(b"authorization", b"")
            key = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            digest, chars = prompt_digest(endpoint, data)
            call = _Call(request_key(rid), call_id, started)
            assert self.emitter is not None
            self.emitter.emit(wire.ClientStart(
                request_id=call.request_id, ts=time.time(), endpoint=endpoint,
                model=_sendable(str(data.get("model", ""))[:128]),
                client_id=headers.get(self.header, b"").decode(errors="replace")[:128],
                user_agent=headers.get(b"user-agent", b"").decode(errors="replace")[:200],
                api_key_sha256=sha256_hex(key) if key else "",
                prompt_sha256=digest, prompt_chars=chars,
                max_tokens=max_tokens_of(endpoint, data),
                call_id=call_id))
            return call
        except Exception as exc:  # noqa: BLE001 - never fail a request over kvscope
            self._error(exc)
            return None

    def _end(self, call: _Call, status: int) -> None:
        try:
            assert self.emitter is not None
            self.emitter.emit(wire.ClientEnd(call.request_id, time.time(), status,
                                             time.perf_counter() - call.started,
                                             call.call_id))
        except Exception as exc:  # noqa: BLE001
            self._error(exc)

    def _error(self, exc: BaseException) -> None:
        """Count a contained error; log the first by its type only: an exception's
        message may quote the request's body (a UnicodeEncodeError holds the whole
        string it failed on, the prompt)."""
        self.errors += 1
        if self.errors == 1:
            log.warning("kvscope middleware: contained an error (%s); counted, not logged "
                         "again", type(exc).__name__)


class _Call:
    """One HTTP call the middleware reported the start of."""

    __slots__ = ("request_id", "call_id", "started")

    def __init__(self, request_id: str, call_id: str, started: float) -> None:
        self.request_id = request_id
        self.call_id = call_id
        self.started = started
