"""OpenAI-compatible completions and chat over httpx, sync and async, with backpressure.

Both clients carry out the plan of :class:`kvscope.client.core.ClientCore`: they send the
client id and a ``kvscope-client/<version>`` User-Agent, delay under pressure, retry
retriable failures, honour Retry-After, raise :class:`CircuitOpenError` without sending
while the circuit is open, and poll the sidecar's ``/health/preempt-rate`` when given its
URL. They never log a prompt, a message, a response body or the API key. Streaming
(``stream=True``) is not supported: a retry cannot replay half a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import httpx

from kvscope import __version__
from kvscope.client.config import ClientConfig
from kvscope.client.core import Action, ClientCore, ClientState, Poll, Send, Sleep
from kvscope.client.errors import ResponseFormatError
from kvscope.http import limits

log = logging.getLogger("kvscope.client")
USER_AGENT = f"kvscope-client/{__version__}"


def capped(timeout: httpx.Timeout, left: float | None) -> httpx.Timeout:
    """The client's ``timeout`` with each phase at most ``left`` seconds (a phase without
    a limit gets ``left``); as it is without a deadline."""
    if left is None:
        return timeout

    def phase(limit: float | None) -> float:
        return left if limit is None else min(limit, left)

    return httpx.Timeout(connect=phase(timeout.connect), read=phase(timeout.read),
                         write=phase(timeout.write), pool=phase(timeout.pool))


class _Base:
    """What the two clients share: validation, URLs, headers, the core."""

    def __init__(self, base_url: str, client_id: str, api_key: str | None,
                 client_id_header: str, preempt_rate_url: str | None,
                 sidecar_token: str | None, config: ClientConfig,
                 clock: Callable[[], float]) -> None:
        for name, value in (("client_id", client_id), ("client_id_header", client_id_header)):
            if not value or any(c in value for c in "\r\n"):
                raise ValueError(f"{name} must be a non-empty single-line string")
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.client_id = client_id
        self.preempt_rate_url = preempt_rate_url
        self.config = config
        self._headers = {"User-Agent": USER_AGENT, client_id_header: client_id}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._sidecar_headers = {"User-Agent": USER_AGENT}
        if sidecar_token:
            self._sidecar_headers["Authorization"] = f"Bearer {sidecar_token}"
        self._core = ClientCore(config, clock, polls_sidecar=preempt_rate_url is not None)

    def state(self) -> ClientState:
        """Window rates, the sidecar's reading, the pressure acted on, the breaker."""
        return self._core.state()

    @staticmethod
    def _body(fixed: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        if extra.get("stream"):
            raise ValueError("kvscope.client does not stream: a retry cannot replay a stream")
        return {**fixed, **extra}

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError as exc:
            raise ResponseFormatError(f"HTTP {response.status_code} answer is not JSON") from exc
        if not isinstance(data, dict):
            raise ResponseFormatError(f"HTTP {response.status_code} answer is not an object")
        return data

    @staticmethod
    def _sidecar_json(response: httpx.Response) -> Any:
        if response.status_code != 200:
            log.debug("kvscope client: sidecar answered HTTP %d", response.status_code)
            return None
        try:
            return response.json()
        except ValueError:
            return None


class KVScopeClient(_Base):
    """Synchronous client. Thread-safe; ``with KVScopeClient(...) as c:`` closes it.

    - ``base_url``: the vLLM server; requests go to ``{base_url}/v1/...`` (a base URL that
      already ends in ``/v1``, the OpenAI SDK habit, is accepted as is).
    - ``client_id`` is sent in ``client_id_header`` on every call, for kvscope's middleware
      to join to the engine's traces; ``api_key`` as ``Authorization: Bearer``.
    - ``preempt_rate_url``: the sidecar's ``/health/preempt-rate``, polled at most every
      ``config.preempt_rate_poll_s`` with ``sidecar_token`` as its bearer token. The poll
      goes through ``http``: default headers set on a client you pass in reach the sidecar
      too (the SDK's own headers, the API key included, are set per call and do not).
    - ``http``: an httpx client to use (not closed by :meth:`close`); else one is made with
      ``config.request_timeout_s``.
    - ``clock`` (monotonic seconds) and ``sleep`` drive every delay and window; tests
      inject fakes.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, client_id: str,
                 api_key: str | None = None, client_id_header: str = "X-Client-Id",
                 preempt_rate_url: str | None = None, sidecar_token: str | None = None,
                 config: ClientConfig | None = None, http: httpx.Client | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        config = config or ClientConfig()
        super().__init__(base_url, client_id, api_key, client_id_header, preempt_rate_url,
                         sidecar_token, config, clock)
        self._owns_http = http is None
        self._http = http or httpx.Client(timeout=config.request_timeout_s, limits=limits())
        self._sleep = sleep

    def completions(self, *, model: str, prompt: str | list[Any], **kw: Any) -> dict[str, Any]:
        """POST /v1/completions; extra keyword arguments go into the JSON body."""
        return self._post("/completions", self._body({"model": model, "prompt": prompt}, kw))

    def chat(self, *, model: str, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        """POST /v1/chat/completions; extra keyword arguments go into the JSON body."""
        body = self._body({"model": model, "messages": messages}, kw)
        return self._post("/chat/completions", body)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        plan = self._core.call()
        try:
            action: Action = next(plan)
            while True:
                action = plan.send(self._perform(action, path, body))
        except StopIteration as done:
            return self._json(done.value)
        finally:
            plan.close()

    def _perform(self, action: Action, path: str, body: dict[str, Any]) -> Any:
        if isinstance(action, Sleep):
            self._sleep(action.seconds)
            return None
        if isinstance(action, Poll):
            assert self.preempt_rate_url is not None
            try:
                return self._sidecar_json(self._http.get(
                    self.preempt_rate_url, headers=self._sidecar_headers,
                    timeout=self.config.preempt_rate_timeout_s))
            except httpx.HTTPError as exc:
                log.debug("kvscope client: sidecar poll failed: %r", exc)
                return None
        assert isinstance(action, Send)
        try:
            return self._http.post(self.base_url + path, json=body, headers=self._headers,
                                   timeout=capped(self._http.timeout, action.time_left))
        except httpx.TransportError as exc:
            return exc

    def close(self) -> None:
        """Close the HTTP client if the SDK created it."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> KVScopeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncKVScopeClient(_Base):
    """Asynchronous client with the same arguments and behaviour as :class:`KVScopeClient`
    (``http`` is an ``httpx.AsyncClient``, ``sleep`` a coroutine function such as
    ``asyncio.sleep``); ``async with`` closes it. Cancelling a call frees its breaker permit.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, client_id: str,
                 api_key: str | None = None, client_id_header: str = "X-Client-Id",
                 preempt_rate_url: str | None = None, sidecar_token: str | None = None,
                 config: ClientConfig | None = None, http: httpx.AsyncClient | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        config = config or ClientConfig()
        super().__init__(base_url, client_id, api_key, client_id_header, preempt_rate_url,
                         sidecar_token, config, clock)
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=config.request_timeout_s, limits=limits())
        self._sleep = sleep

    async def completions(self, *, model: str, prompt: str | list[Any],
                          **kw: Any) -> dict[str, Any]:
        """POST /v1/completions; extra keyword arguments go into the JSON body."""
        return await self._post("/completions",
                                self._body({"model": model, "prompt": prompt}, kw))

    async def chat(self, *, model: str, messages: list[dict[str, Any]],
                   **kw: Any) -> dict[str, Any]:
        """POST /v1/chat/completions; extra keyword arguments go into the JSON body."""
        body = self._body({"model": model, "messages": messages}, kw)
        return await self._post("/chat/completions", body)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        plan: Generator[Action, Any, httpx.Response] = self._core.call()
        try:
            action: Action = next(plan)
            while True:
                action = plan.send(await self._perform(action, path, body))
        except StopIteration as done:
            return self._json(done.value)
        finally:
            plan.close()  # on cancellation this frees a half-open probe slot

    async def _perform(self, action: Action, path: str, body: dict[str, Any]) -> Any:
        if isinstance(action, Sleep):
            await self._sleep(action.seconds)
            return None
        if isinstance(action, Poll):
            assert self.preempt_rate_url is not None
            try:
                return self._sidecar_json(await self._http.get(
                    self.preempt_rate_url, headers=self._sidecar_headers,
                    timeout=self.config.preempt_rate_timeout_s))
            except httpx.HTTPError as exc:
                log.debug("kvscope client: sidecar poll failed: %r", exc)
                return None
        assert isinstance(action, Send)
        try:
            return await self._http.post(
                self.base_url + path, json=body, headers=self._headers,
                timeout=capped(self._http.timeout, action.time_left))
        except httpx.TransportError as exc:
            return exc

    async def aclose(self) -> None:
        """Close the HTTP client if the SDK created it."""
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncKVScopeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
