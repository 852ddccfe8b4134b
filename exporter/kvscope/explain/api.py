"""HTTP for explain: ``GET /api/requests/{id}`` (the answer as JSON, from the store) and
``/ui/requests/{id}`` (a static page that draws it: the timeline and, at each preemption,
the layout with the request's blocks marked).

``explain_router(connect)`` takes a function that opens a clickhouse-connect client on the
sidecar's store database; a client is opened per request and closed after it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Annotated, Any

from clickhouse_connect.driver.exceptions import ClickHouseError
from fastapi import APIRouter, HTTPException, Path
from fastapi.responses import HTMLResponse

from kvscope.explain import answer

MAX_REQUEST_ID = 1024
"""vLLM takes a caller's X-Request-Id of any length, and its engine request IDs embed it;
one over 128 characters is stored as its digest, which explain looks up from the ID
itself. 1,024 characters, each up to 4 UTF-8 bytes and percent-encoded as 12, make a
request line of at most ~12 KiB: inside the 16 KiB head uvicorn's parser takes (and
httpx's 64 KiB URL). 8,192 did not fit either: a path of 3-byte characters was 72 KiB."""
RequestId = Annotated[str, Path(min_length=1, max_length=MAX_REQUEST_ID,
                                description="vLLM's request ID or the caller's X-Request-Id")]
"""Bounded, so a hostile path is a 422, never a query over a megabyte of text. Routed as a
``path``: a caller's ID may hold ``/``, which the server decodes from ``%2F`` before it
routes."""


@cache
def page_html() -> str:
    return (resources.files("kvscope.explain") / "ui" / "request.html").read_text()


def explain_router(connect: Callable[[], Any] | None) -> APIRouter:
    router = APIRouter()

    @router.get("/api/requests/{request_id:path}", summary="Why one request was slow (explain)")
    def explain(request_id: RequestId) -> dict[str, Any]:
        if connect is None:
            # Not a failure of the sidecar (no 5xx): this one keeps no store, by its settings.
            raise HTTPException(404, "this sidecar keeps no store (--clickhouse-dsn off); "
                                     "kvscope explain reads the store")
        try:
            client = connect()
        except Exception as exc:  # noqa: BLE001 - the store is down: say so, no traceback
            raise HTTPException(503, f"store unavailable ({type(exc).__name__})") from None
        try:
            return answer.explain(client, request_id)
        except answer.UnknownRequest:
            raise HTTPException(404, f"no request {request_id!r} in the store") from None
        except ClickHouseError as exc:  # the store failed mid-answer (dropped, timed out)
            raise HTTPException(503, f"store unavailable ({type(exc).__name__})") from None
        finally:
            client.close()

    @router.get("/ui/requests/{request_id:path}", response_class=HTMLResponse,
                summary="One request's story as a page")
    def page(request_id: RequestId) -> HTMLResponse:
        return HTMLResponse(page_html())

    return router
