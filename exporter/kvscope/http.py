"""How kvscope's HTTP clients talk to vLLM's API server: idle connections retire first.

vLLM's uvicorn closes a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds (5 by
default), and httpx keeps an idle connection for 5 seconds by default too. With both at
5 s a request sent on a connection just as the server closes it is lost: the client reads
EOF (``httpx.ReadError``) and the server never logs it. Under load a pool has idle
connections (requests of very different lengths free them unevenly), so a long load hits
it now and then. Retiring idle connections well before the server does narrows the race
to a client that reads a response seconds after the server sent it (a starved process); a
load generator, whose every lost request is a false measurement, reuses no connection.
"""

from __future__ import annotations

import httpx

VLLM_KEEP_ALIVE_S = 5.0
"""vLLM's default ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (a server may set it higher, not lower
without raising the same race for every client)."""
KEEPALIVE_EXPIRY_S = 2.0
"""How long kvscope keeps an idle connection: well under the server's keep-alive."""


def limits(max_connections: int | None = None, *, reuse: bool = True) -> httpx.Limits:
    """Connection limits for a client of vLLM's API server.

    ``reuse=False``: every request opens its own connection and closes it after the
    response, so no request is ever written to a connection the server may be closing.
    """
    return httpx.Limits(max_connections=max_connections,
                        max_keepalive_connections=None if reuse else 0,
                        keepalive_expiry=KEEPALIVE_EXPIRY_S)


def describe(exc: BaseException) -> str:
    """``Type: message`` of a transport error, with the OS error beneath it.

    httpx's ``ReadError`` from a reset connection has an empty message; its cause (e.g.
    ``ConnectionResetError: [Errno 104] Connection reset by peer``) says what happened.
    """
    text = f"{type(exc).__name__}: {exc}"
    seen = {id(exc)}
    inner = exc.__cause__ or exc.__context__
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        text += f" <- {type(inner).__name__}: {inner}"
        inner = inner.__cause__ or inner.__context__
    return text
