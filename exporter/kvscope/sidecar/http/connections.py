"""The sidecar's HTTP connections, held to what a request needs (uvicorn's protocol, two
changes).

uvicorn's ``limit_concurrency`` counts open connections as well as requests in flight,
and gives a connection no deadline until its first response: a peer that opens
``MAX_IN_FLIGHT`` connections and never finishes a request's headers (a slowloris) made
every request 503, ``/healthz`` included, and a liveness probe restarted the sidecar over
and over. Here a request is refused (503) only while ``MAX_IN_FLIGHT`` requests are in
flight, and a connection whose request headers are not complete ``HEADER_TIMEOUT_S``
after it opened, or after its last response, is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

MAX_IN_FLIGHT = 256
HEADER_TIMEOUT_S = 10.0


class RequestBoundProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol (httptools', else h11's) with the two bounds above."""

    _timer: asyncio.TimerHandle | None = None
    _armed_cycle: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _requests_only(self) -> None:
        """uvicorn reads ``limit_concurrency`` as a request's headers complete."""
        self.limit_concurrency = MAX_IN_FLIGHT if len(self.tasks) >= MAX_IN_FLIGHT else None

    if hasattr(AutoHTTPProtocol, "on_headers_complete"):  # httptools
        def on_headers_complete(self) -> None:
            self._requests_only()
            super().on_headers_complete()
    else:  # h11: the check runs in handle_events
        def handle_events(self) -> None:
            self._requests_only()
            super().handle_events()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        self._armed_cycle = self.cycle  # a new request's headers replace it
        self._timer = self.loop.call_later(HEADER_TIMEOUT_S, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.cycle is self._armed_cycle and not self.transport.is_closing():
            self.transport.close()
