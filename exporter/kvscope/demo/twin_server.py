"""The twin behind an OpenAI-compatible ``POST /v1/completions``, for ``kvscope demo``.

So that the demo's workload goes through kvscope's client SDK and middleware exactly as
it would against vLLM, the twin (vLLM's real scheduler, no model) gets a small HTTP front:
the prompt's words are tokenized with the tiny model's vocabulary (``wN`` is token
``N + 4``), the engine request ID is formed as vLLM 0.32 forms it
(``cmpl-<X-Request-Id or random>-0-<8 random hex>``), and the answer comes when the
scheduler finishes the request. The twin steps on its own thread at a fixed pace;
submissions from the HTTP thread are handed over through a queue.
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvscope.models.config import EXTRA_WORDS, NUM_WORDS, SPECIAL_TOKENS
from kvscope.twin import TwinConfig, TwinRequest
from kvscope_probe.middleware import KVScopeMiddleware

VOCAB = (*SPECIAL_TOKENS, *(f"w{i}" for i in range(NUM_WORDS)), *EXTRA_WORDS)
"""The tiny model's word-level vocabulary: a token's id is its position."""
_IDS = {word: i for i, word in enumerate(VOCAB)}
UNK = 0


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` as the tiny model's tokenizer splits it (on whitespace)."""
    return [_IDS.get(word, UNK) for word in text.split()]


@dataclass(frozen=True)
class Finished:
    """What the twin reports when a request ends."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    text: str


class Stopping(RuntimeError):
    """The answer to a request still in the twin when the demo stops."""


Done = Callable[[Finished | Exception], None]


class TwinLoop:
    """Steps a ``Twin`` on its own thread, one step per ``step_s`` while it has work.

    ``submit`` may be called from any thread; every other touch of the scheduler happens
    on the loop's thread. ``on_done`` is called on that thread when a request ends.
    """

    def __init__(self, twin: Any, step_s: float) -> None:
        self.twin = twin
        self.step_s = step_s
        self.steps = 0
        self.inbox: queue.SimpleQueue[tuple[TwinRequest, Done]] = queue.SimpleQueue()
        self.pending: dict[str, tuple[Any, Done]] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-twin", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping; requests still queued or running are answered ``Stopping``."""
        self._stop.set()
        self._thread.join(10)
        self._take_submissions()
        for _, on_done in self.pending.values():
            on_done(Stopping("the demo is stopping"))
        self.pending.clear()

    def submit(self, req: TwinRequest, on_done: Done) -> None:
        self.inbox.put((req, on_done))

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported by the demo, not lost
            self.error = exc

    def _loop(self) -> None:
        next_due = time.perf_counter()
        while not self._stop.is_set():
            self._take_submissions()
            if not self.twin.has_work():
                try:
                    self._add(*self.inbox.get(timeout=0.1))
                except queue.Empty:
                    pass
                next_due = time.perf_counter()
                continue
            self.twin.step()
            self.steps += 1
            self._reap()
            next_due += self.step_s
            late = time.perf_counter() - next_due
            if late > 0:
                next_due += late  # never step in a burst to catch up
            else:
                time.sleep(-late)

    def _take_submissions(self) -> None:
        while True:
            try:
                self._add(*self.inbox.get_nowait())
            except queue.Empty:
                return

    def _add(self, req: TwinRequest, on_done: Done) -> None:
        if self._stop.is_set():
            on_done(Stopping("the demo is stopping"))
            return
        try:
            self.twin.add(req)
        except ValueError as exc:
            on_done(exc)
            return
        self.pending[req.request_id] = (self.twin.scheduler.requests[req.request_id], on_done)

    def _reap(self) -> None:
        live = self.twin.scheduler.requests
        for rid in [rid for rid in self.pending if rid not in live]:
            req, on_done = self.pending.pop(rid)
            reason = req.get_finished_reason()
            on_done(Finished(req.num_prompt_tokens, req.num_output_tokens,
                             "length" if reason is None else str(reason),
                             " ".join(VOCAB[t] for t in req.output_token_ids)))


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "ServiceUnavailableError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


def _resolver(fut: asyncio.Future[Any]) -> Done:
    """A callback for the twin's thread that completes ``fut`` on its own event loop."""
    loop = fut.get_loop()

    def settle(result: Finished | Exception) -> None:
        if not fut.done():
            fut.set_result(result)

    def done(result: Finished | Exception) -> None:
        try:
            loop.call_soon_threadsafe(settle, result)
        except RuntimeError:
            pass  # the HTTP front has shut down; nobody waits for this answer

    return done


def create_app(twin_loop: TwinLoop, cfg: TwinConfig, model: str, endpoint: str) -> FastAPI:
    """``/v1/completions``, ``/v1/models`` and ``/health``, with kvscope's middleware."""
    app = FastAPI(title="kvscope twin (OpenAI-compatible completions)")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model",
                                            "owned_by": "kvscope", "max_model_len":
                                            cfg.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            return _error(400, "prompt must be a string")
        if body.get("model") != model:
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        if body.get("stream"):
            return _error(400, "the twin does not stream")
        ids = tokenize(body["prompt"])
        max_tokens = body.get("max_tokens") or 16
        if not isinstance(max_tokens, int) or max_tokens < 1 or not ids:
            return _error(400, "max_tokens must be a positive integer and prompt non-empty")
        if len(ids) >= cfg.max_model_len:
            return _error(400, f"This model's maximum context length is {cfg.max_model_len} "
                               f"tokens; the prompt has {len(ids)}.")
        external = request.headers.get("x-request-id") or uuid.uuid4().hex
        fut: asyncio.Future[Finished | Exception] = asyncio.get_running_loop().create_future()
        twin_loop.submit(TwinRequest(f"cmpl-{external}-0-{secrets.token_hex(4)}", tuple(ids),
                                     max_tokens, int(body.get("priority") or 0), 0),
                         _resolver(fut))
        result = await fut
        if isinstance(result, Stopping):
            return _error(503, str(result))
        if isinstance(result, Exception):
            return _error(400, str(result))
        return JSONResponse({
            "id": f"cmpl-{external}", "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": result.text, "logprobs": None,
                         "finish_reason": result.finish_reason, "stop_reason": None}],
            "usage": {"prompt_tokens": result.prompt_tokens,
                      "completion_tokens": result.completion_tokens,
                      "total_tokens": result.prompt_tokens + result.completion_tokens},
        })

    app.add_middleware(KVScopeMiddleware, endpoint=endpoint)
    return app


class TwinServer:
    """The twin, its stepping thread and its HTTP front on a free 127.0.0.1 port."""

    def __init__(self, twin: Any, step_s: float, model: str, endpoint: str) -> None:
        self.loop = TwinLoop(twin, step_s)
        self.model = model
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        app = create_app(self.loop, twin.cfg, model, endpoint)
        self._server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="kvscope-twin-http", daemon=True)

    def start(self, timeout_s: float = 15.0) -> None:
        self.loop.start()
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the twin's HTTP front did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self.loop.stop()
        self._thread.join(5)
        self._sock.close()
