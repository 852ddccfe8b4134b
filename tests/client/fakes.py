"""Small stand-ins for what the client SDK meets, each named for what it imitates.

- :class:`FakeClock` imitates ``time.monotonic``: it moves only when a test (or a recorded
  sleep) moves it.
- :class:`RecordedSleep` imitates ``time.sleep`` / ``asyncio.sleep``: it records each
  delay and advances the fake clock by it, so time passes exactly as the SDK asked.
- :class:`FakeOpenAIServer` imitates, at the HTTP level only, vLLM's OpenAI-compatible
  server (``POST /v1/completions``, ``POST /v1/chat/completions``) and the kvscope
  sidecar's ``GET /health/preempt-rate``. It is an ``httpx.MockTransport`` handler, httpx's
  own test transport: requests go through httpx's real client code (headers, JSON
  encoding, timeouts as exceptions) but no socket. It answers from a script of statuses,
  headers and transport exceptions, then with a well-formed 200. The real socket path is
  covered by ``test_real_server.py``.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx


class FakeClock:
    """A monotonic clock that moves only when told."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class RecordedSleep:
    """Records each requested delay and advances the clock by it (sync and async)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.clock.advance(seconds)

    async def async_sleep(self, seconds: float) -> None:
        self(seconds)


@dataclass
class Answer:
    """One scripted answer: a status with headers, or a transport error to raise."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    error: type[httpx.TransportError] | None = None


class FakeOpenAIServer:
    """See the module docstring. ``script`` answers API calls in order, then 200s follow."""

    def __init__(self) -> None:
        self.script: deque[Answer] = deque()
        self.requests: list[httpx.Request] = []
        self.sidecar_requests: list[httpx.Request] = []
        self.preempt_rate: dict[str, Any] | int | None = None
        """The sidecar's JSON answer, an HTTP status to answer with, or None (refused)."""

    def push(self, *answers: Answer | int) -> None:
        for a in answers:
            self.script.append(a if isinstance(a, Answer) else Answer(a))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health/preempt-rate":
            return self._sidecar(request)
        self.requests.append(request)
        answer = self.script.popleft() if self.script else Answer()
        if answer.error is not None:
            raise answer.error("scripted transport failure", request=request)
        if answer.status != 200:
            return httpx.Response(answer.status, headers=answer.headers,
                                  json={"error": {"message": "scripted", "code": answer.status}})
        return httpx.Response(200, headers=answer.headers, json=_completion(request))

    def _sidecar(self, request: httpx.Request) -> httpx.Response:
        self.sidecar_requests.append(request)
        if self.preempt_rate is None:
            raise httpx.ConnectError("sidecar down", request=request)
        if isinstance(self.preempt_rate, int):
            return httpx.Response(self.preempt_rate, json={"error": "scripted"})
        return httpx.Response(200, json=self.preempt_rate)


def preempt_rate(rate: float, requests: int = 100, recommendation: str = "ok") -> dict[str, Any]:
    """A sidecar answer in the shape of ``kvscope.sidecar.http.pressure.preempt_rate``."""
    return {"window_s": 60.0, "preemption_rate": rate, "preemptions": round(rate * requests),
            "requests": requests, "free_block_ratio": 0.2, "waiting": 0, "engines": 1,
            "recommendation": recommendation}


def _completion(request: httpx.Request) -> dict[str, Any]:
    body = json.loads(request.content)
    if request.url.path.endswith("/chat/completions"):
        return {"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hi"}}]}
    return {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
            "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]}
