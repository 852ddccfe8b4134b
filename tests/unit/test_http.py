"""kvscope's clients of vLLM's API server retire idle connections before the server does.

Both at 5 s, a request sent on a connection as vLLM's uvicorn closes it is lost as an
``httpx.ReadError`` that the server never logs: a full CI run saw it once (the hybrid
engine test: 119 of 120 completions, vLLM's access log holding exactly the other 119)."""

from __future__ import annotations

import asyncio

import httpx

from kvscope import http
from kvscope.client import AsyncKVScopeClient, KVScopeClient


def test_idle_connections_retire_before_vllm_closes_them() -> None:
    import vllm.envs as envs

    assert http.VLLM_KEEP_ALIVE_S == envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE == 5
    assert http.KEEPALIVE_EXPIRY_S <= http.VLLM_KEEP_ALIVE_S / 2
    assert http.limits(32).keepalive_expiry == http.KEEPALIVE_EXPIRY_S
    assert http.limits(32).max_connections == 32


def _pool_expiry(client: httpx.Client | httpx.AsyncClient) -> float | None:
    return client._transport._pool._keepalive_expiry  # type: ignore[union-attr]


def test_the_sdk_uses_those_limits() -> None:
    sync = KVScopeClient("http://127.0.0.1:1", client_id="c")
    try:
        assert _pool_expiry(sync._http) == http.KEEPALIVE_EXPIRY_S
    finally:
        sync.close()
    client = AsyncKVScopeClient("http://127.0.0.1:1", client_id="c")
    try:
        assert _pool_expiry(client._http) == http.KEEPALIVE_EXPIRY_S
    finally:
        asyncio.run(client.aclose())


def test_the_demo_workload_uses_them() -> None:
    from kvscope.demo.workload import _http

    demo = _http("agent")
    try:
        assert _pool_expiry(demo) == http.KEEPALIVE_EXPIRY_S
    finally:
        asyncio.run(demo.aclose())
