"""Connections that never finish a request cannot take the sidecar's HTTP server.

uvicorn's ``limit_concurrency`` counted open connections: a peer holding that many
half-sent requests made every request 503, ``/healthz`` (the liveness probe) included,
for as long as it held them. The sidecar's server (``server._uvicorn_config``, uvicorn
as ``kvscope serve`` runs it) bounds requests in flight instead and closes a connection
whose headers do not complete in time.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from kvscope.sidecar.config import ServeConfig
from kvscope.sidecar.http import connections
from kvscope.sidecar.http.app import create_app
from kvscope.sidecar.server import _uvicorn_config
from kvscope.state.hub import Hub

LIMIT = 4


@pytest.fixture()
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(connections, "MAX_IN_FLIGHT", LIMIT)
    monkeypatch.setattr(connections, "HEADER_TIMEOUT_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServeConfig(host="127.0.0.1", port=port)
    app = create_app(Hub(), CollectorRegistry())
    config = _uvicorn_config(cfg, app)
    config.limit_concurrency = LIMIT
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield base
    srv.should_exit = True
    t.join(10)


def half_sent(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the headers never end
    return s


def test_half_sent_requests_do_not_make_healthz_fail(server: str) -> None:
    held = [half_sent(server) for _ in range(LIMIT)]
    try:
        time.sleep(0.2)  # the server has taken them
        assert httpx.get(f"{server}/healthz", timeout=5).status_code == 200
    finally:
        for s in held:
            s.close()


def test_a_connection_that_never_finishes_its_headers_is_closed(server: str) -> None:
    s = half_sent(server)
    try:
        s.settimeout(10)
        assert s.recv(1024) == b""  # closed by the server after HEADER_TIMEOUT_S
    finally:
        s.close()
    # a request answered in time keeps its connection for the next one
    with httpx.Client() as c:
        assert c.get(f"{server}/healthz").status_code == 200
        assert c.get(f"{server}/healthz").status_code == 200
