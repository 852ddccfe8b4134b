"""A request-body limit for the sidecar's HTTP server (pure ASGI).

No route of the sidecar takes a body, and uvicorn bounds headers but not bodies. A
declared ``Content-Length`` over the limit is refused with 413 before a byte of the body
is read; a streamed (chunked) body is read up to the limit and refused once it passes it.
"""

from __future__ import annotations

import json
from typing import Any

MAX_BODY_BYTES = 1 << 20


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit():  # uvicorn refuses these already; be sure
                await self._refuse(send, 400, "malformed Content-Length")
                return
            if int(length) > self.max_bytes:
                await self._refuse(send)
                return
            await self.app(scope, receive, send)
            return
        if b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)
            return
        messages, size = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not msg.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed() -> Any:
            msg = next(replay, None)
            return msg if msg is not None else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, send: Any, status: int = 413, error: str = "") -> None:
        error = error or f"request body over {self.max_bytes} bytes"
        body = json.dumps({"error": error}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
