"""The sidecar's HTTP surface: /metrics, /healthz, /api/engines (OpenAPI at /openapi.json)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvscope import __version__
from kvscope.sidecar.bodylimit import MAX_BODY_BYTES, BodyLimit
from kvscope.sidecar.engine import EngineState
from kvscope.sidecar.hub import Hub
from kvscope.sidecar.pressure import PressurePolicy, preempt_rate

OPEN_PATHS = ("/healthz",)
QUERY_TOKEN_PATHS = ("/ui",)  # a browser cannot set a header to load the page itself


def engine_summary(st: EngineState) -> dict[str, Any]:
    """What the sidecar knows about one engine, as plain JSON."""
    h, c, ex, led = st.hello, st.counters, st.extremes, st.ledger
    last = st.last_step
    out: dict[str, Any] = {
        "engine": h.engine,
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
    health_timeout_s: float,
    token: str | None = None,
    receiver_error: Any = None,
    policy: PressurePolicy | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(title="kvscope sidecar", version=__version__)
    policy = policy or PressurePolicy()

    if token:
        expected = f"Bearer {token}".encode()

        @app.middleware("http")
        async def require_token(request: Request, call_next: Any) -> Any:
            if request.url.path in OPEN_PATHS:
                return await call_next(request)
            given = request.headers.get("authorization", "").encode()
            if request.url.path in QUERY_TOKEN_PATHS and "token" in request.query_params:
                given = f"Bearer {request.query_params['token']}".encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
            return await call_next(request)

    @app.get("/metrics", summary="Prometheus exposition of every engine")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="200 while probe records keep arriving")
    def healthz() -> JSONResponse:
        err = receiver_error() if callable(receiver_error) else None
        age = hub.seconds_since_record()
        body: dict[str, Any] = {
            "engines": sorted(hub.engines),
            "seconds_since_record": age,
            "health_timeout_s": health_timeout_s,
        }
        if err is not None:
            body["status"], code = f"receiver stopped: {type(err).__name__}", 503
        elif age is None:
            body["status"], code = "no probe record yet", 503
        elif age > health_timeout_s:
            body["status"], code = "probe silent", 503
        else:
            body["status"], code = "ok", 200
        return JSONResponse(body, status_code=code)

    @app.get("/health/preempt-rate", summary="Preemption pressure for autoscalers and clients")
    def pressure(window: float = Query(60.0, ge=5.0, le=3600.0)) -> dict[str, Any]:
        with hub.lock:
            return preempt_rate(list(hub.engines.values()), window, policy)

    @app.get("/api/engines", summary="What the sidecar knows about each engine")
    def engines() -> dict[str, Any]:
        with hub.lock:
            return {
                "engines": [engine_summary(s) for s in hub.engines.values()],
                "frames_rejected": dict(hub.rejected),
            }

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)  # outermost: before the token
    return app
