"""Health routes: ``/healthz`` (liveness: the sidecar itself works) and ``/readyz``
(readiness: a probe is connected and none is silent; each engine's state listed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from kvscope.state.hub import Hub
from kvscope.state.presence import CONNECTED


def readiness(hub: Hub) -> tuple[bool, list[dict[str, Any]]]:
    """Whether the sidecar is ready, and each engine's state (call with the hub lock)."""
    t = hub.health_timeout_s
    out = [{"key": s.key, "server": s.server, "engine": s.engine, "model": s.hello.model,
            "pid": s.hello.pid, "session": s.hello.session,
            **hub.presence[s.hello.session].as_json(t)} for s in hub.engines.values()]
    # Heard only through heartbeats since this sidecar started: its hello comes with the
    # engine's next step.
    out += [{"key": None, "server": None, "engine": p.engine, "model": None, "pid": None,
             "session": p.session, **p.as_json(t)} for p in hub.pending.values()]
    states = [e["state"] for e in out]
    return any(s in CONNECTED for s in states) and "silent" not in states, out


def health_router(hub: Hub, receiver_alive: Callable[[], bool] | None = None) -> APIRouter:
    """The two health routes; ``receiver_alive`` says whether the receiver thread runs."""
    router = APIRouter()

    def receiver_ok() -> bool:
        return receiver_alive() if receiver_alive is not None else True

    @router.get("/healthz", summary="Liveness: 200 while the sidecar itself works")
    def healthz() -> JSONResponse:
        ok = receiver_ok()
        body = {"status": "ok" if ok else "receiver stopped",
                "uptime_s": round(time.monotonic() - hub.started_monotonic, 3)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @router.get("/readyz", summary="Readiness: 200 while a probe is connected and none is silent")
    def readyz() -> JSONResponse:
        with hub.lock:
            ready, engines = readiness(hub)
        if not receiver_ok():
            status, ready = "receiver stopped", False
        elif ready:
            status = "ok"
        elif any(e["state"] == "silent" for e in engines):
            status = "probe silent"
        else:
            status = "no probe connected"
        return JSONResponse({"status": status, "health_timeout_s": hub.health_timeout_s,
                             "engines": engines}, status_code=200 if ready else 503)

    return router
