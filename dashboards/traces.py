"""Layer 2, requests and traces (ClickHouse): the hourly preemption table, who was
preempted and what it cost, and one request's timeline.

Every panel is a saved query (clickhouse/queries, or dashboards/queries), so
``kvscope query NAME`` prints the same table.
"""

from __future__ import annotations

from typing import Any

from dashboards import clickhouse as sql
from dashboards import panels as p
from dashboards.blocks import engine_variables
from dashboards.config import Config

SIDECAR_URL = "http://localhost:9477"
EXPLAIN = ("Explain ${__value.raw} (kvscope explain)",
           "${sidecar}/ui/requests/${__value.raw:percentencode}")
"""The data link on a request ID: the sidecar's page of ``kvscope explain``."""


def variables(cfg: Config) -> list[Any]:
    days = sql.load("hourly_preemptions").defaults["days"]
    limit = sql.load("top_preempted_requests").defaults["limit"]
    return [
        p.datasource("prometheus", "Prometheus"),
        p.datasource("clickhouse", "ClickHouse"),
        *engine_variables(cfg),
        p.custom("days", "Days", ["1", "7", "30", "90"], days,
                 "Window of the tables, in days back from now (as kvscope query --param days)."),
        p.custom("limit", "Rows", ["10", "20", "50", "100"], limit, "Rows of the top lists."),
        p.textbox("request_id", "Request ID",
                  "An engine request ID (click one in a table) for the timeline below."),
        p.textbox("sidecar", "Sidecar URL",
                  "Where the browser reaches the kvscope sidecar: the request ID's "
                  "'Explain' link opens its /ui/requests page.", SIDECAR_URL),
    ]


def build(cfg: Config) -> p.Board:
    b = p.Board(cfg, cfg.uids.requests, "kvscope / Requests and traces",
                "Per-request traces in ClickHouse: preemptions per hour, the victims, one "
                "request's story.")
    b.variables(*variables(cfg))
    this = f"/d/{cfg.uids.requests}"
    victim = (f"{this}?var-request_id=${{__value.raw:percentencode}}&${{server:queryparam}}"
              "&${engine:queryparam}&${model:queryparam}&${days:queryparam}&${__url_time_range}")
    b.row("Preemptions per hour").add(p.grid(
        "Hourly preemption rate (last $days days)",
        "Per hour (UTC): requests that ended, those preempted at least once and their "
        "share, preemptions, the average blocks the failed allocation needed, and the "
        "lowest max-contiguous-free run seen at a preemption and at an admission. "
        "kvscope query hourly_preemptions.",
        p.ch(sql.render("hourly_preemptions")), h=10,
        units={"preemption_rate": "percentunit", "hour": "dateTimeAsIso"}))
    b.row("Who was preempted").add(
        p.grid("Most preempted requests (last $days days)",
               "Most preemptions first, then most recomputed tokens. Click a request ID for "
               "its timeline. kvscope query top_preempted_requests.",
               p.ch(sql.render("top_preempted_requests")), h=10,
               links={"request_id": [("Timeline of ${__value.raw}", victim), EXPLAIN]},
               units={"queue_seconds": "s", "e2e_seconds": "s"}),
        p.grid("Blocks needed vs free at each preemption (last $days days)",
               "Per reason: preemptions whose failed allocation needed more blocks than were "
               "free, and those with enough free blocks but no long enough run (only there "
               "could contiguity matter; on vLLM V1 it never does). "
               "kvscope query blocks_needed_vs_free.",
               p.ch(sql.render("blocks_needed_vs_free")), w=12, h=8),
        p.grid("What preemptions cost (last $days days)",
               "Tokens computed a second time after a resume and the end-to-end time of "
               "preempted vs never-preempted requests. kvscope query preemption_cost.",
               p.ch(sql.render("preemption_cost")), w=12, h=8,
               units={"recomputed_ratio": "percentunit"}),
        p.grid("Tail waste by prompt length (last $days days)",
               "Token slots reserved but never filled, per prompt-length bucket, each request "
               "in its engine's own block size (engine_configs); engines with more than one "
               "KV cache group are left out. kvscope query tail_waste_by_prompt_len.",
               p.ch(sql.render("tail_waste_by_prompt_len")),
               h=8, units={"waste_ratio": "percentunit"}),
    )
    b.row("One request: $request_id").add(
        p.grid("Trace of $request_id",
               "The request's row in request_traces (written when it ended).",
               p.ch(sql.render("request_trace")), h=5,
               units={"queue_seconds": "s", "first_token_seconds": "s", "e2e_seconds": "s"}),
        p.grid("Timeline of $request_id",
               "Every lifecycle event of the request with the pool's state at that moment "
               "(request_events_all: request_events and request_allocations unrolled).",
               p.ch(sql.render("request_timeline")), h=10),
    )
    return b
