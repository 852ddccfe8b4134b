"""HTTP for layer 3: ``/api/layout``, ``/api/layout/history`` and the ``/ui`` page.

``layout_router(hub, sampler)`` returns an APIRouter for the app to include. The JSON
shapes are described by ``layout.schema.json`` beside this module. ``/ui`` is a static
page holding no data (everything it shows comes from ``/api/layout``). With a bearer
token set, open ``/ui?token=TOKEN``: the app accepts the token from the URL for the page
itself, and the page sends it as an Authorization header with every fetch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import HTMLResponse

from kvscope.layout.sampler import LayoutSampler, Point, Snapshot
from kvscope.layout.snapshot import STATE_NAMES
from kvscope.state.capacity import head_fit
from kvscope.state.engine import EngineState
from kvscope.state.hub import Hub
from kvscope.times import epoch_seconds
from kvscope_probe.recorder import MAX_FAULTS

MAX_RUNS = 200_000
PREEMPTIONS_SHOWN = 12


def snapshot_json(s: Snapshot, max_runs: int) -> dict[str, Any]:
    """A snapshot's layout; at most ``max_runs`` runs (then ``truncated`` is true)."""
    runs = s.runs[:max_runs]
    return {
        "ts": s.ts,
        "step": s.step,
        "step_ts": s.step_ts,
        "session": s.session,
        "num_blocks": s.num_blocks,
        "summary": {
            "free_blocks": s.free_blocks,
            "cached_evictable_blocks": s.cached_blocks,
            "used_blocks": s.used_blocks,
            "max_contiguous_free_blocks": s.max_contiguous_free,
            "budget_utilization": s.budget_utilization,
            "running": s.running,
            "waiting": s.waiting,
        },
        "runs": runs.tolist(),
        "runs_total": int(s.runs.shape[0]),
        "blocks_covered": int(runs[:, 3].sum()) if runs.size else 0,
        "truncated": int(s.runs.shape[0]) > max_runs,
        "owners": [
            {"req_id": o.req_id, "blocks": o.blocks, "fragments": o.fragments,
             "tokens": o.tokens, "shared_blocks": o.shared_blocks,
             "groups": [t.as_json(g) for g, t in enumerate(o.groups)]}
            for o in s.owners
        ],
    }


def history_json(points: list[Point], n: int) -> dict[str, list[Any]]:
    pts = points[-n:] if n else []
    return {
        "ts": [p.ts for p in pts],
        "free_blocks": [p.free_blocks for p in pts],
        "max_contiguous_free_blocks": [p.max_contiguous_free for p in pts],
        "budget_utilization": [p.budget_utilization for p in pts],
    }


def preemptions_json(st: EngineState) -> list[dict[str, Any]]:
    """The latest preemptions, newest first, with the facts that explain each."""
    return [
        p.as_json()
        for p in reversed(list(st.recent_preemptions)[-PREEMPTIONS_SHOWN:])
    ]


def probe_json(st: EngineState) -> dict[str, Any]:
    """What the page's probe banner says: features this vLLM did not match the probe's
    fingerprint for (not recorded; ``hash_field`` is only a faster read, left out), the
    probe switched off by its own faults, the audit finding vLLM's pool different."""
    disabled = dict(getattr(st.hello, "disabled", None) or {})
    disabled.pop("hash_field", None)
    return {
        "disabled": disabled,
        "faults": st.probe_faults,
        "switched_off": st.probe_faults >= MAX_FAULTS,
        "audit_mismatches": dict(st.audit.mismatches),
        "audit_blocks": st.audit.blocks,
    }


def engine_layout(st: EngineState, sampler: LayoutSampler, max_runs: int,
                  history_points: int, now: float) -> dict[str, Any]:
    """One engine's entry of /api/layout; call with the hub lock held."""
    h = st.hello
    snap = sampler.latest(st.key)
    if snap is not None and snap.session != h.session:
        snap = None  # the engine restarted; its first sample is on its way
    if not st.ledger.synced:
        status = "stale"
    elif snap is None or sampler.is_stale(st.key):
        status = "waiting"
    else:
        status = "ok"
    fit = head_fit(h, st.last_step, st.ledger.free if st.ledger.synced else None)
    out: dict[str, Any] = {
        "key": st.key,
        "server": st.server,
        "engine": h.engine,
        "model": h.model,
        "pid": h.pid,
        "session": h.session,
        "policy": h.policy,
        "num_blocks": h.num_blocks,
        "block_size": h.block_size,
        "kv_groups": [{"index": i, "kind": g.kind, "block_size": g.block_size}
                      for i, g in enumerate(h.kv_groups)],
        "states": list(STATE_NAMES),
        "status": status,
        "age_s": None if snap is None else max(0.0, now - snap.ts),
        "layout": snapshot_json(snap, max_runs) if status == "ok" and snap else None,
        "last_synced_ts": None if snap is None else snap.ts,
        "history": history_json(sampler.points(st.key), history_points),
        "preemptions_total": dict(st.counters.preemptions),
        "preemptions": preemptions_json(st),
        "waiting_head": None if fit is None else fit.as_json(),
        "probe": probe_json(st),
    }
    return out


LATEST_TIME_S = 253_402_300_799.0
"""9999-12-31T23:59:59Z: the last time a store's DateTime64 takes and ISO 8601 writes."""


def parse_time(value: str | None, default: float, name: str) -> float:
    """A query parameter's time (epoch seconds or ISO 8601, from 1970 to 9999),
    ``default`` when absent."""
    if value is None or value == "":
        return default
    try:
        t = epoch_seconds(value)
    except ValueError:
        raise HTTPException(422, f"{name}: not epoch seconds or ISO 8601: {value[:40]!r}") from None
    if not 0.0 <= t <= LATEST_TIME_S:
        raise HTTPException(422, f"{name}: outside 1970-01-01 to 9999-12-31: {value[:40]!r}")
    return t


@cache
def ui_html() -> str:
    return (resources.files("kvscope.layout") / "ui" / "index.html").read_text("utf-8")


def resolve_engine(hub: Hub, engine: str | None) -> str:
    """The engine key a query names (its key, or a label only one engine has; optional
    when there is one engine); 422 / 404 otherwise."""
    with hub.lock:
        names = sorted(hub.engines)
        labels = [s.key for s in hub.engines.values() if s.engine == engine]
    if engine is not None and engine not in names and len(labels) == 1:
        return labels[0]
    if engine is None:
        if len(names) != 1:
            raise HTTPException(422, f"engine is required; engines: {', '.join(names)}")
        return names[0]
    if engine not in names:
        raise HTTPException(404, f"no engine {engine!r}")
    return engine


def newest_within(snaps: list[Snapshot], limit: int, max_runs: int,
                  ) -> tuple[list[dict[str, Any]], bool]:
    """The newest snapshots that fit ``limit`` and ``max_runs`` in all, oldest first, and
    whether any was left out."""
    truncated = len(snaps) > limit
    out, budget = [], max_runs
    for s in reversed(snaps[-limit:]):
        if s.runs.shape[0] > budget:
            truncated = True
            break
        budget -= s.runs.shape[0]
        out.append(snapshot_json(s, max_runs))
    out.reverse()
    return out, truncated


def layout_router(hub: Hub, sampler: LayoutSampler,
                  store_history: Callable[[str, float, float, int, int], list[Any]] | None = None,
                  ) -> APIRouter:
    """Routes for layer 3; ``store_history`` reads snapshots older than the sampler's
    memory (from ClickHouse ``layout_snapshots``) when a store is configured."""
    router = APIRouter()

    @router.get("/api/layout", summary="Each engine's KV block pool, run-length encoded")
    def layout(
        engine: str | None = Query(None, description="only this engine (its key, or its "
                                   "engine label: every server's)"),
        max_runs: int = Query(20_000, ge=1, le=MAX_RUNS, description="runs per engine"),
        history_points: int = Query(600, ge=0, le=3600, description="sparkline points"),
    ) -> dict[str, Any]:
        now = time.time()
        with hub.lock:
            states = [s for s in hub.engines.values()
                      if engine is None or engine in (s.key, s.engine)]
            body = [engine_layout(s, sampler, max_runs, history_points, now) for s in states]
        if engine is not None and not body:
            raise HTTPException(404, f"no engine {engine!r}")
        return {"ts": now, "interval_s": sampler.interval_s, "engines": body}

    @router.get("/api/layout/history", summary="One engine's layout snapshots over time")
    def history(
        engine: str | None = Query(None, description="engine key (or a label only one "
                                   "engine has); optional with one engine"),
        since: str | None = Query(None, description="epoch seconds or ISO 8601; default -10 min"),
        until: str | None = Query(None, description="epoch seconds or ISO 8601; default now"),
        limit: int = Query(600, ge=1, le=3600, description="most snapshots returned"),
        max_runs: int = Query(MAX_RUNS, ge=1, le=MAX_RUNS, description="runs in all"),
    ) -> dict[str, Any]:
        now = time.time()
        t1 = parse_time(until, now, "until")
        t0 = parse_time(since, max(0.0, t1 - 600), "since")
        if t0 > t1:
            raise HTTPException(422, "since is after until")
        engine = resolve_engine(hub, engine)
        snaps = sampler.snapshots(engine, t0, t1)
        source = "memory"
        oldest = sampler.oldest_ts(engine)
        if store_history is not None and (oldest is None or t0 < oldest - sampler.interval_s):
            try:
                snaps = store_history(engine, t0, t1, limit + 1, max_runs)
                source = "clickhouse"
            except Exception as exc:  # noqa: BLE001 - the store may be down: say so
                raise HTTPException(503, f"layout history store unavailable: "
                                         f"{type(exc).__name__}") from None
        out, truncated = newest_within(snaps, limit, max_runs)
        return {"engine": engine, "source": source, "since": t0, "until": t1,
                "interval_s": sampler.interval_s, "truncated": truncated, "snapshots": out}

    @router.get("/ui", response_class=HTMLResponse, summary="Live KV block layout page")
    def ui() -> HTMLResponse:
        return HTMLResponse(ui_html(), headers={"Cache-Control": "no-cache"})

    return router
