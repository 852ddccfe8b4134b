"""The counterfactual of one request: the recorded window around it replayed on the twin
(vLLM's real scheduler) under the server's settings, checked against what the server did
(the fidelity gate of ``kvscope whatif --baseline``), then under alternatives, each with
this request's preemptions and latency in steps. A failing gate: no alternatives shown.

The window is every request of the same engine that arrived from ``window_s`` before this
one up to its end (saved query ``replay_traffic``), steps counted from the window's first
arrival. Requests already running when the window opens are not in it: a short window can
fail the gate for that reason, which the gate then says. Nor are requests of another life
of the engine (another probe session: it restarted within the window), or of another
count of its steps by the sidecar (the sidecar restarted within the window), whose steps
count from 1 again.

The server's settings are given by hand (``kvscope whatif --baseline``'s syntax) or, with
``ENGINE``, read from the store: the hello of the engine's probe session
(``engine_configs``), rebuilt for the twin by ``kvscope.whatif.engine_settings``.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvscope.store.query import SavedQuery, run_saved

STEP_KEYS = ("arrival_step", "admitted_step", "finished_step")
ENGINE = "engine"
"""``baseline``: the engine's own settings, from its stored hello."""


def window_records(client: Any, engine: str, server: str, since: float,
                   until: float, rid: str | None = None) -> list[dict[str, Any]]:
    """replay_traffic rows of the window, steps shifted to start at 0; with ``rid``, of
    that request's engine life only (its probe session: the steps of a life before or
    after a restart count from 1 again, under maybe other settings) and of the sidecar
    count it arrived in (``step_counter``: a sidecar restarted while the engine ran on
    counts the steps it stores from 1 again too)."""
    cols, rows = run_saved(client, SavedQuery.load("replay_traffic"),
                           {"since": str(since), "until": str(until), "engine": engine,
                            "server": server})
    recs = [dict(zip(cols, r, strict=True)) for r in rows]
    life = next(((r["session"], r["step_counter"]) for r in recs if r["request_id"] == rid),
                None)
    if life is not None:
        recs = [r for r in recs if (r["session"], r["step_counter"]) == life]
    origin = min((r["arrival_step"] for r in recs), default=0)
    for r in recs:
        for k in STEP_KEYS:
            if r[k] is not None:
                r[k] -= origin
    return recs


def alternatives(base: Any) -> list[tuple[str, Any]]:
    """The settings worth asking about, from the server's: a larger pool, fewer running
    requests, priority scheduling, a larger block size at the same KV memory. One may be
    a pool vLLM refuses (``refusal``): ``counterfactual`` reports it, runs the others."""
    blocks = base.num_blocks + max(1, base.num_blocks // 2)
    out = [("1.5x blocks", replace(base, num_blocks=blocks)),
           ("max_seqs / 2", replace(base, max_num_seqs=max(1, base.max_num_seqs // 2),
                                    max_num_batched_tokens=base.max_num_batched_tokens))]
    if base.policy != "priority":
        out.append(("priority policy", replace(base, policy="priority")))
    out.append(("2x block size", replace(base, block_size=base.block_size * 2,
                                         num_blocks=max(2, base.num_blocks // 2))))
    return out


def counterfactual(client: Any, engine: str, server: str, rid: str, *, queued_ts: float,
                   end_ts: float, baseline: str, window_s: float = 60.0,
                   model: dict[str, Any] | None = None, max_model_len: int = 1024,
                   seed: int = 0) -> dict[str, Any]:
    """The gate and, when it passes, each alternative's outcome for ``rid``.
    ``baseline``: the server's settings, or ``ENGINE`` for those its hello stated."""
    from kvscope.explain.source import engine_config
    from kvscope.whatif.engine_settings import NotReplayable, from_config
    from kvscope.whatif.measure import measure
    from kvscope.whatif.recorded import Fidelity, figures
    from kvscope.whatif.replay import load

    recs = window_records(client, engine, server, queued_ts - window_s, end_ts, rid)
    index = next((i for i, r in enumerate(recs) if r["request_id"] == rid), None)
    errors: list[str] = []
    settings = {"from": "given", "spec": baseline}
    if baseline == ENGINE:
        row = engine_config(client, engine, server, queued_ts)
        if row is None:
            return {"window": len(recs), "errors": [
                "the store holds no settings of this engine (engine_configs: a sidecar "
                "before it, or that table not written): give the settings by hand"]}
        try:
            got = from_config(row)
        except NotReplayable as exc:
            return {"window": len(recs), "errors": [str(exc)]}
        baseline, max_model_len, model = got.spec, got.max_model_len, got.model
        settings = {"from": "engine", "spec": baseline, "session": row["session"]}
    found = server_setting(baseline, max_model_len=max_model_len, model=model, errors=errors)
    if errors or index is None:
        return {"window": len(recs), "settings": settings,
                "errors": errors or [f"{rid} is not in the window"]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "window.json"
        path.write_text(json.dumps(recs, default=str))
        replay = load(path, seed=seed, step_ms=20.0, max_model_len=max_model_len)
    twin_id = replay.requests[[r["request_id"] for r in replay.records].index(rid)].request_id
    base = found[0].config
    m = measure(base, replay.requests, seed=seed)
    gate = Fidelity("server", figures(replay.records, m.usable_blocks),
                    figures(m.records, m.usable_blocks))
    recorded = replay.records[[r["request_id"] for r in replay.records].index(rid)]
    out: dict[str, Any] = {"window": len(recs), "settings": settings,
                           "max_model_len": max_model_len, "fidelity": gate.as_dict(),
                           "recorded": outcome(recorded), "server": outcome_of(m, twin_id),
                           "alternatives": []}
    if not gate.trusted:
        return out
    for name, cfg in alternatives(base):
        why = refusal(cfg)
        if why is not None:
            out["alternatives"].append({"setting": name, "preemptions": None,
                                        "latency_steps": None, "refused": why})
            continue
        out["alternatives"].append({"setting": name, **outcome_of(measure(cfg, replay.requests,
                                                                          seed=seed), twin_id)})
    return out


def server_setting(baseline: str, *, max_model_len: int, model: dict[str, Any] | None,
                   errors: list[str]) -> list[Any]:
    """``baseline`` (whatif's ``key:value,...``) as whatif builds the server's setting;
    every problem appended to ``errors`` (the CLI checks a hand-given one before it
    reads the store: ``problems``)."""
    from kvscope.whatif.settings import KEYS, build

    return build({k: [] for k in KEYS}, [f"server={baseline}"], max_model_len=max_model_len,
                 bytes_per_token=1, errors=errors, model=model)


def problems(baseline: str, *, max_model_len: int, model: dict[str, Any] | None) -> list[str]:
    """What is wrong with a hand-given ``--counterfactual`` setting; empty when it builds
    (``ENGINE`` is read from the store and checked there)."""
    errors: list[str] = []
    if baseline != ENGINE:
        server_setting(baseline, max_model_len=max_model_len, model=model, errors=errors)
    return errors


def refusal(cfg: Any) -> str | None:
    """Why vLLM would not start with ``cfg`` (an alternative near vLLM's smallest pool:
    twice the block size at half the blocks can hold less than max_model_len), None when
    it would: the twin's checks, then vLLM's own as the scheduler is built."""
    from kvscope.twin.scheduler import build_scheduler

    problems = cfg.validate()
    if problems:
        return " ".join(problems)
    try:
        build_scheduler(cfg)
    except ValueError as exc:  # vLLM's check of the pool for the layout
        return str(exc).removeprefix("invalid TwinConfig: ")
    return None


def outcome(rec: dict[str, Any]) -> dict[str, Any]:
    steps = (None if rec.get("finished_step") is None
             else rec["finished_step"] - rec["arrival_step"])
    return {"preemptions": int(rec["preempt_count"]), "latency_steps": steps}


def outcome_of(m: Any, twin_id: str) -> dict[str, Any]:
    rec = next((r for r in m.records if r["request_id"] == twin_id), None)
    return {"preemptions": None, "latency_steps": None} if rec is None else outcome(rec)
