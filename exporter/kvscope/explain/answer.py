"""The answer for one request ID: its engine requests' stories with the pool's state at
each decision, as the plain dict ``render_json`` documents (schema ``kvscope.explain/1``).

The ID may be vLLM's engine request ID or the caller's ``X-Request-Id`` (the middleware's
``client_requests.request_id``), which may fan out to several engine requests.
"""

from __future__ import annotations

import shlex
from collections import Counter
from typing import Any

from kvscope.explain import holders, source
from kvscope.explain.story import Preemption, Story, build, spans

SCHEMA = "kvscope.explain/1"
DECISIONS = ("preempt", "admission_blocked", "never_fits")


class UnknownRequest(LookupError):
    """No engine event and no API request carries this ID."""


def explain(client: Any, rid: str) -> dict[str, Any]:
    """The whole answer for ``rid``; ``UnknownRequest`` when the store never saw it."""
    api = source.client_rows(client, rid)
    ids = [rid] if source.engines_of(client, rid) else []
    for row in api:
        ids += [x for x in source.engine_ids(row) if x not in ids]
    if not ids:
        raise UnknownRequest(rid)
    who = {r["request_id"]: r for r in api}
    stories = [request_answer(client, e, who) for e in ids]
    for s in stories:
        if s is not None:  # what the API server spent beyond the engine's part
            s["outside_engine_s"] = (round(api[0]["duration_s"] - s["lost"]["total"]["seconds"],
                                           6) if len(api) == 1 and len(ids) == 1
                                     and s["lost"] is not None else None)
    return {"schema": SCHEMA, "request_id": rid,
            "api_requests": [_api(r) for r in api],
            "engine_requests": [s for s in stories if s is not None]}


def request_answer(client: Any, rid: str, who: dict[str, dict]) -> dict[str, Any] | None:
    """The story of one engine request on the (first) engine that saw it."""
    engines = source.engines_of(client, rid)
    if not engines:
        return None
    model, server, engine = engines[0]
    events = source.request_events(client, engine, server, rid)
    run = source.run_of(client, events)
    trace = source.traces(client, [rid], engine, server).get(rid)
    story = build(events, lambda n: source.first_event_after(client, run, n),
                  trace["preempt_count"] if trace else None)
    lo, hi = events[0]["ts"], events[-1]["ts"]
    decided = source.decisions(client, engine, server, DECISIONS, lo, hi)
    spanning = len({e["step_counter"] for e in events}) > 1  # a sidecar restart in its life
    for p in story.preemptions:
        _pool_at_preemption(client, source.run_at(client, run, p.event, spanning), story, p)
    return {
        "request_id": rid, "model": model, "server": server, "engine": engine,
        "trace": trace, "timeline": events, "spans": spans(events),
        "lost": None if story.incomplete else {
            k: getattr(story, k).as_json()
            for k in ("waiting", "preempted", "recomputing", "running", "total")},
        "incomplete": story.incomplete,
        "preemptions": [_preemption(p, decided) for p in story.preemptions],
        "waiting": _waiting(client, run, story, trace, decided, spanning),
        "verdict": verdict(story),
    }


def _pool_at_preemption(client: Any, run: source.Run, story: Story, p: Preemption) -> None:
    step = p.event["step"]
    held = holders.blocks_held(source.live_events(client, run, step))
    p.trigger = holders.trigger_event(source.step_events(client, run, step), p.requester)
    snap = source.layout_at(client, run, step)
    p.cached_blocks = snap["cached_blocks"] if snap else -1
    p.layout = layout_json(snap, story.request_id)
    p.holders = holders.top_holders(held, source.traces(client, list(held), run.engine,
                                                        run.server))


def _preemption(p: Preemption, decided: list[dict]) -> dict[str, Any]:
    e = p.event
    dec = next((d for d in decided if d["decision"] == "preempt"
                and d["request_id"] == e["request_id"] and abs(d["ts"] - e["ts"]) < 0.002), None)
    return {
        "ts": e["ts"], "step": e["step"], "reason": e["reason"],
        "blocks_needed": p.blocks_needed, "free_blocks": e["free_blocks"],
        "cached_evictable_blocks": p.cached_blocks, "victim_blocks": e["blocks"],
        "tokens_lost": e["tokens"], "policy": dec["policy"] if dec else "",
        "requester": p.requester,
        "requester_is_victim": p.requester == e["request_id"],
        "trigger": None if p.trigger is None else {
            "event": p.trigger["event"], "step": p.trigger["step"],
            "blocks": p.trigger["blocks"], "total_blocks": p.trigger["total_blocks"]},
        "resumed": None if p.resumed is None else {"ts": p.resumed["ts"],
                                                    "step": p.resumed["step"]},
        "holders": p.holders,
        "layout": p.layout,
    }


def layout_json(snap: dict | None, rid: str) -> dict[str, Any] | None:
    """The layout sample at or before a step, with the blocks ``rid`` held in it (empty
    when it was not running at that sample: samples are taken apart from steps)."""
    if snap is None:
        return None
    names = snap["owner_req_ids"]
    mine = names.index(rid) + 1 if rid in names else 0  # owner is 1-based, 0 none
    return {"ts": snap["ts"], "step": snap["step"], "num_blocks": snap["num_blocks"],
            "states": list(snap["states"]),
            "request_blocks": [i for i, o in enumerate(snap["owner"]) if mine and o == mine]}


def _waiting(client: Any, run: source.Run, story: Story, trace: dict | None,
             decided: list[dict], spanning: bool) -> dict[str, Any] | None:
    """The pool while it waited to be admitted, as the first step it waited through began:
    the step whose record reported its arrival (vLLM's loop met it in that step's
    ``schedule()`` and did not admit it)."""
    if not story.queued or story.waiting.steps <= 0:
        return None
    step = story.queued["step"]
    run = source.run_at(client, run, story.queued, spanning)
    held = holders.blocks_held(source.live_events(client, run, step))
    held.pop(story.request_id, None)
    snap = source.layout_at(client, run, step)
    config = source.engine_config(client, story.engine, story.server, story.queued["ts"])
    blocked = Counter(d["reason"] for d in decided if d["decision"] == "admission_blocked"
                      and d["request_id"] == story.request_id)
    return {"step": step,
            "admission_blocked": sum(blocked.values()),
            "admission_blocked_reasons": dict(sorted(blocked.items())),
            "holders": holders.top_holders(held, source.traces(client, list(held), run.engine,
                                                               run.server)),
            "could_fit": holders.could_fit(
                trace, config, [d for d in decided if d["decision"] == "never_fits"],
                story.request_id, snap["num_blocks"] if snap else -1)}


def verdict(story: Story) -> str:
    """One line: where the time went."""
    if story.incomplete and (story.end is not None or len(story.incomplete) > 1):
        return f"incomplete: {'; '.join(story.incomplete)}; where its time went is not known"
    if story.end is None:
        return "not ended yet (or its end was not recorded): the story so far"
    n = len(story.preemptions)
    total = story.total.seconds or 1e-9
    parts = [f"waited {story.waiting.seconds:.3f} s ({story.waiting.seconds / total:.0%})"]
    if n:
        parts.append(f"preempted {n} time{'s' * (n != 1)}, {story.preempted.seconds:.3f} s "
                     f"out and {story.recomputing.seconds:.3f} s recomputing")
    else:
        parts.append("never preempted")
    return "; ".join(parts)


def _api(row: dict) -> dict[str, Any]:
    return {**{k: row[k] for k in source.CLIENT_COLUMNS}, "engine_ids": source.engine_ids(row)}


def worst(client: Any, n: int, since: float, server: str = "",
          engine: str = "") -> dict[str, Any]:
    """The ``n`` requests queued since ``since`` that lost the most time waiting to be
    admitted or preempted (on ``server`` and ``engine`` when given), with each one's
    ``kvscope explain`` command."""
    rows = source.worst(client, n, since, server, engine)
    for r in rows:
        r["lost_s"] = round(r["waiting_s"] + r["preempted_s"], 6)
        r["command"] = f"kvscope explain {shlex.quote(r['request_id'])}"
    return {"schema": SCHEMA, "since": since, "server": server, "engine": engine,
            "requests": rows}
