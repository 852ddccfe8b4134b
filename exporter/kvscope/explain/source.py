"""What ``kvscope explain`` reads from the store, and nothing else: every SQL it runs.

Per-request lifecycle events are read through ``events`` alone, so a change in how the
store keeps them (a table split, a view) is one edit here. Rows come back as plain dicts
with epoch-second floats, the shapes of ``kvscope.store.rows``.

Step numbers restart with every run of an engine (its restart, or the sidecar's: the new
``EngineState`` counts from 0); every query by step is bounded by the time span of the
asked request's run (``Run``, ``run_of``), or it read other runs' requests as holders of
the pool, and their steps as this one's. Rows stored since ``step_counter`` name the
sidecar count of their step: the pool at one event is read from that event's count alone
(``run_at``), so a request whose events span a sidecar restart is read right on each side.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

RUN_SEARCH_S = 86_400.0
"""How far before a request's first event and after its last the bounds of its run are
looked for: no request lives a day, so no holder of the pool at one of its steps came
earlier, and the queries by step read at most this much more of the store."""


@dataclass(frozen=True)
class Run:
    """The time span (epoch seconds, both ends excluded) of one run of one engine."""

    engine: str
    server: str
    lo: float
    hi: float
    counter: str = ""
    """The sidecar count (``step_counter``) whose steps these are; '' when not known."""

    def where(self, counted: bool = True) -> str:
        """``counted``: the table has ``step_counter`` (the request events do, the layout
        samples not: the time span bounds those)."""
        # the float bounds are exact (ts as stored, both ends excluded); the DateTime64
        # ones let the store skip parts by its sort key (model, server, engine, ts)
        return ("engine = {e:String} AND server = {s:String} AND toFloat64(ts) > {lo:Float64} "
                "AND toFloat64(ts) < {hi:Float64} AND ts >= toDateTime64({lo:Float64}, 3) "
                "AND ts <= toDateTime64({hi:Float64}, 3)"
                + (" AND step_counter = {c:String}" if counted and self.counter else ""))

    def params(self, **more: Any) -> dict[str, Any]:
        return {"e": self.engine, "s": self.server, "lo": self.lo, "hi": self.hi,
                "c": self.counter, **more}

EVENT_COLUMNS = ("ts", "model", "engine", "server", "request_id", "event", "step", "blocks",
                 "total_blocks", "free_blocks", "max_contiguous_free", "tokens", "reason",
                 "detail", "requester", "step_counter")
TRACE_COLUMNS = ("ts", "model", "engine", "server", "request_id", "prompt_len", "max_gen_len",
                 "output_len", "required_blocks", "allocated_blocks", "preempt_count",
                 "recomputed_tokens", "cached_tokens", "arrival_ts", "queue_seconds",
                 "e2e_seconds", "finish_reason", "client_id", "user_agent")
CLIENT_COLUMNS = ("ts", "request_id", "engine_request_ids", "client_id", "user_agent",
                  "endpoint", "http_status", "duration_s", "preempt_count", "engine_ids")
_EPOCH = {"ts", "arrival_ts"}


def _rows(client: Any, sql: str, params: dict[str, Any], cols: tuple[str, ...],
          blank: tuple[str, ...] = ()) -> list[dict]:
    """``cols`` of the rows ``sql`` selects (``{cols}``); those in ``blank`` read ''."""
    picked = ", ".join(f"toFloat64({c}) AS {c}" if c in _EPOCH else
                       f"'' AS {c}" if c in blank else c for c in cols)
    result = client.query(sql.replace("{cols}", picked), parameters=params)
    return [dict(zip(cols, r, strict=True)) for r in result.result_rows]


_NAMED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def counts_named(client: Any) -> bool:
    """Whether the store's request events name their sidecar count (``step_counter``,
    schema 160 and 170): a newer CLI reading a store older sidecars still write reads
    every row as of no named count, as it did before. Asked once per client (a sidecar
    migrates its store before it reads it; a CLI runs one command)."""
    named = _NAMED.get(client)
    if named is None:
        r = client.query("SELECT count() FROM system.columns WHERE database = "
                         "currentDatabase() AND table = 'request_events_all' AND name = "
                         "'step_counter'")
        named = _NAMED[client] = bool(r.result_rows[0][0])
    return named


WITHIN_STEP = ("indexOf(['queued', 'preempted', 'admitted', 'resumed', 'allocated', "
               "'taken_up', 'finished', 'aborted'], event)")


def events(client: Any, where: str, params: dict[str, Any], limit: int = 0,
           order: str = "step, ts") -> list[dict]:
    """Lifecycle events matching ``where`` (SQL over request_events' columns), in the
    order they happened: by step, then time, then the order within a step. A step's
    preemptions precede its admissions, resumes and allocations (the probe stamps those
    with the step's time, at the end of its ``schedule()``; a preemption happened in it,
    or before it: ``reset_prefix_cache`` preempts what that ``schedule()`` resumes), so a
    millisecond tie puts ``preempted`` first. Read through ``request_events_all``: the
    lifecycle rows and each allocation unrolled."""
    return _rows(client, "SELECT {cols} FROM request_events_all WHERE " + where
                 + f" ORDER BY {order}, {WITHIN_STEP}"
                 + (f" LIMIT {int(limit)}" if limit else ""), params, EVENT_COLUMNS,
                 () if counts_named(client) else ("step_counter",))


def run_of(client: Any, events_: list[dict]) -> Run:
    """The run of the engine that one request's ``events_`` (in order) belong to. Within a
    run, the events stamped at a step (all but ``queued``, which carries the API server's
    arrival time) come in step order in time: an event before the request's first with a
    later step is another run's, as is one after its last with an earlier step."""
    timed = [e for e in events_ if e["event"] != "queued"] or events_
    first, last = timed[0], timed[-1]
    r = client.query(
        "SELECT countIf(toFloat64(ts) < {t0:Float64} AND step > {s0:Int64}), "
        "maxIf(toFloat64(ts), toFloat64(ts) < {t0:Float64} AND step > {s0:Int64}), "
        "countIf(toFloat64(ts) > {t1:Float64} AND step < {s1:Int64}), "
        "minIf(toFloat64(ts), toFloat64(ts) > {t1:Float64} AND step < {s1:Int64}) "
        "FROM request_events_all WHERE engine = {e:String} AND server = {s:String} "
        "AND event != 'queued' AND ts >= toDateTime64({lo:Float64}, 3) "
        "AND ts <= toDateTime64({hi:Float64}, 3)",
        parameters={"e": first["engine"], "s": first["server"], "t0": first["ts"],
                    "s0": first["step"], "t1": last["ts"], "s1": last["step"],
                    "lo": first["ts"] - RUN_SEARCH_S, "hi": last["ts"] + RUN_SEARCH_S})
    before, start, after, end = r.result_rows[0]
    return Run(first["engine"], first["server"],
               start if before else events_[0]["ts"] - RUN_SEARCH_S,
               end if after else events_[-1]["ts"] + RUN_SEARCH_S)


def run_at(client: Any, run: Run, event: dict, spanning: bool) -> Run:
    """The run of ``event``'s own step: the request events of the sidecar count it names
    alone (``run`` for a row stored before counts were named). When the request's events
    span several counts (``spanning``: a sidecar restarted in its life), the time span is
    that count's, its first and last rows (looked for within ``RUN_SEARCH_S`` of it): the
    layout samples, which name no count, are then read within it, so a sample is of that
    count, though the last ones a count took after its last row may be missed for an
    earlier one (a sample is the sidecar's clock after it ingested the step). Otherwise
    the request's ``run``."""
    counter = event["step_counter"]
    if not counter:
        return run
    if not spanning:
        return Run(run.engine, run.server, run.lo, run.hi, counter)
    r = client.query(
        "SELECT toFloat64(min(ts)), toFloat64(max(ts)) FROM request_events_all "
        "WHERE engine = {e:String} AND server = {s:String} AND step_counter = {c:String} "
        "AND ts >= toDateTime64({lo:Float64}, 3) AND ts <= toDateTime64({hi:Float64}, 3)",
        parameters={"e": run.engine, "s": run.server, "c": counter,
                    "lo": event["ts"] - RUN_SEARCH_S, "hi": event["ts"] + RUN_SEARCH_S})
    first, last = r.result_rows[0]
    return Run(run.engine, run.server, first - 0.001, last + 0.001, counter)


def first_event_after(client: Any, run: Run, step: int) -> dict | None:
    """The run's first event in a step after ``step`` (when that step began)."""
    rows = events(client, run.where() + " AND step > {n:Int64}", run.params(n=step), limit=1)
    return rows[0] if rows else None


def step_events(client: Any, run: Run, step: int) -> list[dict]:
    """The run's events in ``step``."""
    return events(client, run.where() + " AND step = {n:Int64}", run.params(n=step))


def request_events(client: Any, engine: str, server: str, rid: str) -> list[dict]:
    """One request's events in time order (then step): its steps restart when the
    sidecar does, so by step first a row of the run before sorted last."""
    return events(client, "engine = {e:String} AND server = {s:String} AND "
                          "request_id = {r:String}", {"e": engine, "s": server, "r": rid},
                  order="ts, step")


def live_events(client: Any, run: Run, step: int) -> list[dict]:
    """Events before ``step`` of every request that still had an event at or after it, or
    has no end in the run (running still, as an answer right after ``step`` finds the
    requests that have not grown since): the requests that could hold blocks as that step
    began. A request whose end came in ``step``'s record is not one: vLLM freed its blocks
    in ``update_from_output``, before that step's ``schedule()``, and the probe sends the
    end with the next step's record."""
    w = run.where()
    return events(client, w + " AND step < {n:Int64} AND (request_id IN (SELECT request_id "
                  "FROM request_events_all WHERE " + w + " AND step >= {n:Int64}) OR "
                  "request_id NOT IN (SELECT request_id FROM request_events WHERE " + w
                  + " AND event IN ('finished', 'aborted'))) AND request_id NOT IN (SELECT "
                  "request_id FROM request_events WHERE " + w + " AND step = {n:Int64} AND "
                  "event IN ('finished', 'aborted'))", run.params(n=step))


def engines_of(client: Any, rid: str) -> list[tuple[str, str, str]]:
    """(model, server, engine) of every engine that saw request ``rid``, the first to see
    it first."""
    r = client.query("SELECT model, server, engine FROM request_events WHERE request_id = "
                     "{r:String} GROUP BY model, server, engine ORDER BY min(ts), server, "
                     "engine", parameters={"r": rid})
    return [tuple(x) for x in r.result_rows]


def client_rows(client: Any, rid: str) -> list[dict]:
    """API requests whose own ID (the caller's X-Request-Id) or joined engine IDs is ``rid``.
    The middleware sends an ID over 128 characters (or one UTF-8 cannot encode) as its
    digest, and the store keeps that: ``rid`` is looked up as itself and as the digest."""
    from kvscope_probe.middleware import request_key

    return _rows(client, "SELECT {cols} FROM client_requests WHERE request_id IN "
                         "{k:Array(String)} OR has(engine_ids, {r:String}) OR "
                         "(empty(engine_ids) AND has(splitByChar(',', engine_request_ids), "
                         "{r:String})) ORDER BY ts",
                 {"r": rid, "k": sorted({rid, request_key(rid)})}, CLIENT_COLUMNS)


def engine_ids(row: dict) -> list[str]:
    """A client row's engine request IDs. A row written before ``engine_ids`` was stored
    (clickhouse/schema/130) has none there: its comma-joined ``engine_request_ids`` is split
    as it was then (exact unless an ID holds a comma, which such rows cannot say)."""
    return list(row["engine_ids"]) or [x for x in row["engine_request_ids"].split(",") if x]


def traces(client: Any, rids: list[str], engine: str, server: str) -> dict[str, dict]:
    """The traces of ``rids`` on one engine (vLLM's request IDs are unique per server)."""
    if not rids:
        return {}
    rows = _rows(client, "SELECT {cols} FROM request_traces WHERE engine = {e:String} AND "
                         "server = {s:String} AND request_id IN {r:Array(String)} ORDER BY ts",
                 {"e": engine, "s": server, "r": rids}, TRACE_COLUMNS)
    return {r["request_id"]: r for r in rows}


def decisions(client: Any, engine: str, server: str, kinds: tuple[str, ...],
              lo: float, hi: float) -> list[dict]:
    """Decisions of ``kinds`` on one engine between two times (epoch seconds)."""
    cols = ("ts", "decision", "request_id", "reason", "blocks_needed", "free_blocks",
            "tokens", "policy", "msg")
    return _rows(client, "SELECT {cols} FROM scheduler_decisions WHERE engine = {e:String} "
                         "AND server = {s:String} AND decision IN {k:Array(String)} AND "
                         "toFloat64(ts) BETWEEN {lo:Float64} AND {hi:Float64} ORDER BY ts",
                 {"e": engine, "s": server, "k": list(kinds), "lo": lo - 0.001,
                  "hi": hi + 0.001}, cols)


def layout_at(client: Any, run: Run, step: int) -> dict | None:
    """The run's last layout sample taken at or before ``step``, if any."""
    cols = ("ts", "step", "num_blocks", "free_blocks", "cached_blocks", "used_blocks",
            "running", "waiting", "states", "owner", "owner_req_ids", "owner_blocks")
    rows = _rows(client, "SELECT {cols} FROM layout_snapshots WHERE " + run.where(False)
                 + " AND step <= {n:Int64} ORDER BY step DESC, ts DESC LIMIT 1",
                 run.params(n=step), cols)
    return rows[0] if rows else None


CONFIG_COLUMNS = ("ts", "session", "vllm_version", "num_blocks", "block_size",
                  "kv_group_kinds", "kv_group_block_sizes", "kv_group_windows",
                  "max_num_batched_tokens", "max_num_seqs", "max_model_len", "policy",
                  "prefix_caching", "async_scheduling", "spec_tokens")


def engine_config(client: Any, engine: str, server: str, at: float) -> dict | None:
    """The engine's settings as its probe session's hello stated them: the latest
    ``engine_configs`` row at or before ``at`` (epoch seconds), if any."""
    rows = _rows(client, "SELECT {cols} FROM engine_configs WHERE engine = {e:String} AND "
                         "server = {s:String} AND toFloat64(ts) <= {at:Float64} ORDER BY ts "
                         "DESC LIMIT 1", {"e": engine, "s": server, "at": at + 0.001},
                 CONFIG_COLUMNS)
    return rows[0] if rows else None


def worst(client: Any, n: int, since: float, server: str, engine: str = "") -> list[dict]:
    """The ``n`` ended requests that lost the most seconds waiting to be admitted and
    preempted (resumed minus preempted times), most first; one that ended while it waited
    or sat preempted (aborted) lost the time until its end there."""
    cols = ("request_id", "server", "engine", "waiting_s", "preempted_s", "preemptions")
    return _rows(client, """
        SELECT {cols} FROM (
          SELECT request_id, server, engine,
            toFloat64(maxIf(ts, event IN ('finished', 'aborted'))) AS end_s,
            if(countIf(event = 'admitted') > 0, toFloat64(minIf(ts, event = 'admitted')),
               end_s) - toFloat64(minIf(ts, event = 'queued')) AS waiting_s,
            sumIf(toFloat64(ts), event = 'resumed') - sumIf(toFloat64(ts), event = 'preempted')
              + (countIf(event = 'preempted') - countIf(event = 'resumed')) * end_s
              AS preempted_s,
            countIf(event = 'preempted') AS preemptions
          FROM request_events
          WHERE ({s:String} = '' OR server = {s:String})
            AND ({e:String} = '' OR engine = {e:String})
          GROUP BY server, engine, request_id
          HAVING countIf(event IN ('finished', 'aborted')) > 0
             AND countIf(event = 'queued') > 0
             AND toFloat64(minIf(ts, event = 'queued')) >= {since:Float64})
        ORDER BY waiting_s + preempted_s DESC, request_id LIMIT {n:UInt32}""",
                 {"s": server, "e": engine, "since": since, "n": n}, cols)
