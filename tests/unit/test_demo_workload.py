"""The demo's clients (kvscope.demo.workload) against a stand-in API server."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from kvscope.demo import workload as wl


def test_each_client_keeps_at_most_its_pool_of_calls_open(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job is due at once (a step of 0 s); the server answers slowly. Each client
    hands httpx at most IN_FLIGHT calls: the rest wait on the client's semaphore, not in
    httpcore's pool queue, which it rescans at every change (1,000 queued calls made the
    demo's event loop run 24 s late)."""
    open_now: Counter[str] = Counter()
    most: Counter[str] = Counter()
    answered: Counter[str] = Counter()

    async def server(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/health"):
            return httpx.Response(503)  # the SDK then acts on its own outcomes
        client = request.headers["X-Client-Id"]
        open_now[client] += 1
        most[client] = max(most[client], open_now[client])
        await asyncio.sleep(0.01)
        open_now[client] -= 1
        answered[client] += 1
        return httpx.Response(200, json={"id": "cmpl-x", "choices": [{"text": "x"}],
                                         "usage": {"prompt_tokens": 1,
                                                   "completion_tokens": 1}})

    def mock_http(app: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(server),
                                 base_url="http://api.test")

    monkeypatch.setattr(wl, "IN_FLIGHT", 4)
    monkeypatch.setattr(wl, "_http", mock_http)
    jobs = wl.plan(200, seed=0, step_s=0.0)
    work = wl.Workload(jobs, "http://api.test/v1", "tiny", "http://sidecar.test",
                       send_priority=False)
    asyncio.run(work.run())
    assert work.done == work.total == sum(answered.values())
    assert all(t.failed == 0 for t in work.tallies.values())
    # never more than the bound, and the bound reached (the jobs come in waves of 25)
    assert max(most.values()) == 4 and all(n <= 4 for n in most.values()), most
