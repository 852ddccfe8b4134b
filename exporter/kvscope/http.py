"""How kvscope's HTTP clients talk to vLLM's API server: idle connections retire first.

vLLM's uvicorn closes a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds (5 by
default), and httpx keeps an idle connection for 5 seconds by default too. With both at
5 s a request sent on a connection just as the server closes it is lost: the client reads
EOF (``httpx.ReadError``) and the server never logs it. Under load a pool has idle
connections (requests of very different lengths free them unevenly), so a long load hits
it now and then. Retiring idle connections well before the server does removes the race.
"""

from __future__ import annotations

import httpx

VLLM_KEEP_ALIVE_S = 5.0
"""vLLM's default ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (a server may set it higher, not lower
without raising the same race for every client)."""
KEEPALIVE_EXPIRY_S = 2.0
"""How long kvscope keeps an idle connection: well under the server's keep-alive."""


def limits(max_connections: int | None = None) -> httpx.Limits:
    """Connection limits for a client of vLLM's API server."""
    return httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S)
