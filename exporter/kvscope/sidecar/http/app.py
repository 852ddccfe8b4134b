"""The sidecar's HTTP surface: /metrics, /healthz, /readyz, /api/engines (OpenAPI at
/openapi.json).

/healthz is liveness (the sidecar itself works); /readyz is readiness (a probe is
connected and none is silent), with each engine's state. Both are open without the token,
for probes; /readyz lists each engine's identity (key, server, engine, model, PID,
session) and presence (state, ages, heartbeats), no figure and no request.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvscope import __version__
from kvscope.sidecar.http.bodylimit import MAX_BODY_BYTES, BodyLimit
from kvscope.sidecar.http.health import health_router
from kvscope.sidecar.http.pressure import PressurePolicy, preempt_rate
from kvscope.state.engine import EngineState
from kvscope.state.hub import Hub
from kvscope.state.presence import CONNECTED

OPEN_PATHS = ("/healthz", "/readyz")
QUERY_TOKEN_PATHS = ("/ui",)  # a browser cannot set a header to load the page itself
QUERY_TOKEN_PREFIXES = ("/ui/requests/",)


def engine_summary(st: EngineState, hub: Hub) -> dict[str, Any]:
    """What the sidecar knows about one engine, as plain JSON (call with the hub lock)."""
    h, c, ex, led = st.hello, st.counters, st.extremes, st.ledger
    last = st.last_step
    out: dict[str, Any] = {
        "key": st.key,
        "server": st.server,
        "engine": h.engine,
        "dp_rank": h.dp_rank,
        **hub.presence[h.session].as_json(hub.health_timeout_s),
        "model": h.model,
        "vllm_version": h.vllm_version,
        "pid": h.pid,
        "session": h.session,
        "policy": h.policy,
        "num_blocks": h.num_blocks,
        "block_size": h.block_size,
        "token_budget": h.token_budget,
        "max_num_seqs": h.max_num_seqs,
        "synced": led.synced,
        "steps": c.steps,
        "preemptions": dict(c.preemptions),
        "preempted_tokens": c.preempted_tokens,
        "recomputed_tokens": c.recomputed_tokens,
        "requests_arrived": c.arrivals,
        "requests_ended": dict(c.ends),
        "probe_records_dropped": st.probe_dropped,
        "probe_faults": st.probe_faults,
        "ledger_gaps": c.gaps,
        "ledger_mismatches": c.ledger_mismatches,
        "audit_blocks": st.audit.blocks,
        "audit_tables": st.audit.tables,
        "audit_mismatches": dict(st.audit.mismatches),
        "audit_pass_seconds": st.audit.pass_seconds,
        "mean_budget_utilization": ex.util_sum / ex.util_steps if ex.util_steps else None,
        "mean_budget_utilization_when_no_free_blocks": (
            ex.util_at_zero_free_sum / ex.util_at_zero_free_steps
            if ex.util_at_zero_free_steps else None
        ),
        "steps_with_no_free_blocks": ex.util_at_zero_free_steps,
        "lowest_free_blocks": ex.min_free,
        "lowest_max_contiguous_free_blocks": ex.min_max_contiguous,
        "peak_used_blocks": ex.peak_used,
        "running": last.running if last else None,
        "waiting": last.waiting if last else None,
    }
    if led.synced:
        out.update(
            free_blocks=led.free,
            cached_evictable_blocks=led.cached,
            used_blocks=led.used,
            max_contiguous_free_blocks=st.max_contiguous_free(),
            tail_waste_tokens=led.tail_waste_tokens(),
        )
    out["recent_preemptions"] = [p.as_json() for p in list(st.recent_preemptions)[-20:]]
    return out


def create_app(
    hub: Hub,
    registry: CollectorRegistry,
    *,
    health_timeout_s: float | None = None,
    token: str | None = None,
    receiver_alive: Callable[[], bool] | None = None,
    policy: PressurePolicy | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(title="kvscope sidecar", version=__version__)
    policy = policy or PressurePolicy()
    if health_timeout_s is not None:
        hub.health_timeout_s = health_timeout_s  # one timeout: the hub's

    if token:
        _require_token(app, token)

    @app.get("/metrics", summary="Prometheus exposition of every engine")
    def metrics(request: Request) -> Response:
        # As prometheus_client's own handler: OpenMetrics when the scraper asks for it
        # (Prometheus does, and exemplars need it), the text format otherwise.
        encoder, content_type = choose_encoder(request.headers.get("accept"))
        return Response(encoder(registry), media_type=content_type)

    app.include_router(health_router(hub, receiver_alive))

    @app.get("/health/preempt-rate", summary="Preemption pressure for autoscalers and clients")
    def pressure(window: float = Query(60.0, ge=5.0, le=3600.0)) -> dict[str, Any]:
        with hub.lock:
            return preempt_rate(list(hub.engines.values()), window, policy,
                                connected=lambda st: hub.state_of(st) in CONNECTED)

    @app.get("/api/engines", summary="What the sidecar knows about each engine")
    def engines() -> dict[str, Any]:
        with hub.lock:
            return {
                "engines": [engine_summary(s, hub) for s in hub.engines.values()],
                "frames_rejected": dict(hub.rejected),
                "identity_collisions": [{"server": srv, "engine": eng, "count": n}
                                        for (srv, eng), n in hub.collisions.items()],
            }

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # outermost: before the token
    return app


def _require_token(app: FastAPI, token: str) -> None:
    """Every path but the health checks needs ``Authorization: Bearer <token>``
    (``/ui`` also takes ``?token=``, which a browser can send)."""
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def require_token(request: Request, call_next: Any) -> Any:
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        page = (request.url.path in QUERY_TOKEN_PATHS
                or request.url.path.startswith(QUERY_TOKEN_PREFIXES))
        if page and "token" in request.query_params:
            given = f"Bearer {request.query_params['token']}".encode()
        if not hmac.compare_digest(given, expected):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)
