"""One harness drives the sync and the async client through identical scenarios."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvscope.client import AsyncKVScopeClient, ClientConfig, KVScopeClient
from tests.client.fakes import FakeClock, FakeOpenAIServer, RecordedSleep

EXACT = {"jitter_ratio": 0.0}
"""Config overrides that make every delay exact."""


class Harness:
    """A client of either kind wired to a fake clock, a recorded sleep and a fake server."""

    def __init__(self, kind: str, config: ClientConfig, http_timeout: float = 600.0,
                 **client_kw: Any) -> None:
        self.kind = kind
        self.clock = FakeClock()
        self.sleep = RecordedSleep(self.clock)
        self.server = FakeOpenAIServer()
        kw: dict[str, Any] = {"client_id": "team-a", "config": config, "clock": self.clock,
                              **client_kw}
        if kind == "sync":
            self.client: Any = KVScopeClient(
                http=httpx.Client(transport=self.server.transport(), timeout=http_timeout),
                sleep=self.sleep, **kw)
        else:
            self.loop = asyncio.new_event_loop()
            self.client = AsyncKVScopeClient(
                http=httpx.AsyncClient(transport=self.server.transport(),
                                       timeout=http_timeout),
                sleep=self.sleep.async_sleep, **kw)

    def run(self, result: Any) -> Any:
        return self.loop.run_until_complete(result) if self.kind == "async" else result

    def complete(self, **kw: Any) -> dict[str, Any]:
        kw.setdefault("model", "tiny")
        kw.setdefault("prompt", "hello")
        return self.run(self.client.completions(**kw))  # type: ignore[no-any-return]

    def chat(self, **kw: Any) -> dict[str, Any]:
        kw.setdefault("model", "tiny")
        kw.setdefault("messages", [{"role": "user", "content": "hello"}])
        return self.run(self.client.chat(**kw))  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.kind == "sync":
            self.client._http.close()
        else:
            self.loop.run_until_complete(self.client._http.aclose())
            self.loop.close()


MakeHarness = Callable[..., Harness]


@pytest.fixture(params=["sync", "async"])
def make(request: pytest.FixtureRequest) -> Iterator[MakeHarness]:
    """``make(**config_overrides, client_kw={...})`` builds a harness of the param's kind."""
    made: list[Harness] = []

    def factory(client_kw: dict[str, Any] | None = None, **overrides: Any) -> Harness:
        h = Harness(request.param, ClientConfig(**{**EXACT, **overrides}), **(client_kw or {}))
        made.append(h)
        return h

    yield factory
    for h in made:
        h.close()
