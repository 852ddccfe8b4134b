"""kvscope's clients of vLLM's API server retire idle connections before the server does.

Both at 5 s, a request sent on a connection as vLLM's uvicorn closes it is lost as an
``httpx.ReadError`` that the server never logs: a full CI run saw it once (the hybrid
engine test: 119 of 120 completions, vLLM's access log holding exactly the other 119)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvscope import http
from kvscope.client import AsyncKVScopeClient, KVScopeClient
from kvscope.load.mix import LoadSpec, run_load_sync


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


class ClosingServer:
    """A completions endpoint that answers the first request on each connection (kept
    alive) and resets the connection when a second arrives on it: the moment vLLM's
    uvicorn closes an idle connection just as a client writes to it, made certain."""

    BODY = b'{"id": "cmpl-x", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'

    def __init__(self) -> None:
        self.connections = 0
        self.answered = 0
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._turns(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):  # the client closed it
            writer.close()

    async def _shut(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _turns(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for turn in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if turn == 1:  # the second request on this connection: reset it, unanswered
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            self.answered += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY))
            await writer.drain()

    def close(self) -> None:
        """Stop serving and close the loop. Left to the garbage collector, the loop and what
        it held were finalised during pytest's imports at the session's end, and CPython
        3.11.7's AST constructor failed the session there after every test had passed
        ("SystemError: AST constructor recursion depth mismatch", this file run alone, 9
        runs of 9)."""
        asyncio.run_coroutine_threadsafe(self._shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def closing_server() -> Iterator[ClosingServer]:
    server = ClosingServer()
    yield server
    server.close()


def test_a_reused_connection_the_server_closes_loses_the_request(
        closing_server: ClosingServer) -> None:
    """The failure itself (CI, stop 29: 79 of 80 completions, ``ReadError: ``): a pooled
    client's second request goes out on the kept-alive connection and is lost."""
    with httpx.Client(base_url=f"http://127.0.0.1:{closing_server.port}", trust_env=False,
                      limits=http.limits(1)) as client:
        assert client.post("/v1/completions", json={}).status_code == 200
        with pytest.raises(httpx.ReadError) as caught:
            client.post("/v1/completions", json={})
    assert closing_server.answered == 1
    assert "ConnectionResetError" in http.describe(caught.value), http.describe(caught.value)


def test_the_load_generator_never_writes_to_a_connection_the_server_may_close(
        closing_server: ClosingServer) -> None:
    spec = LoadSpec(n_requests=12, concurrency=3)
    result = run_load_sync(f"http://127.0.0.1:{closing_server.port}", spec)
    assert (result.ok, result.error_count, result.errors) == (12, 0, [])
    assert closing_server.connections == closing_server.answered == 12


def test_the_demo_clients_never_write_to_a_connection_the_server_may_close(
        closing_server: ClosingServer) -> None:
    """The demo's clients are a load generator too: one lost request is a failed request in
    its findings (CI, this stop: ``kvscope demo --engine vllm``, 40/40 answered, 1 failed,
    ``ReadError: ``)."""
    from kvscope.demo.workload import _http

    async def send(n: int) -> list[int]:
        demo = _http("agent")
        try:
            url = f"http://127.0.0.1:{closing_server.port}/v1/completions"
            return [(await demo.post(url, json={})).status_code for _ in range(n)]
        finally:
            await demo.aclose()

    assert asyncio.run(send(6)) == [200] * 6
    assert closing_server.connections == closing_server.answered == 6
