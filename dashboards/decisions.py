"""Layer 4, decisions: the decision log in Loki (loki/queries.logql, each scoped to the
engine variable), and the same decisions counted in ClickHouse.
"""

from __future__ import annotations

from pathlib import Path

from dashboards import clickhouse as sql
from dashboards import panels as p
from dashboards.blocks import engine_variables
from dashboards.config import Config
from dashboards.panels import ID
from kvscope.decisions.logql import read_queries

LOGQL = Path(__file__).resolve().parents[1] / "loki" / "queries.logql"
STREAM = '{job="kvscope"'


def logql(name: str) -> str:
    """The saved LogQL query ``name`` with ``engine=~"$engine"`` added to its stream."""
    queries = {q.name: q.query for q in read_queries(LOGQL)}
    q = queries[name]
    if q.count(STREAM) != 1:
        raise ValueError(f"LogQL query {name} must select {STREAM}...}} exactly once: {q}")
    return q.replace(STREAM, STREAM + ', server=~"$server", engine=~"$engine"')


def build(cfg: Config) -> p.Board:
    b = p.Board(cfg, cfg.uids.decisions, "kvscope / Decisions",
                "The scheduler's decision log (Loki): preemptions with their facts, blocked "
                "admissions, resumes.")
    b.variables(p.datasource("prometheus", "Prometheus"), p.datasource("loki", "Loki"),
                p.datasource("clickhouse", "ClickHouse"), *engine_variables(cfg))
    timeline = (f"/d/{cfg.uids.requests}?var-request_id=${{__value.raw:percentencode}}"
                "&${server:queryparam}&${engine:queryparam}&${__url_time_range}")
    b.row("Counts").add(
        p.graph("Preemptions by reason",
                "Preemption lines per reason, 5-minute windows. loki/queries.logql: "
                "preemptions_by_reason.",
                p.loki_q(logql("preemptions_by_reason"), "{{reason}}")),
        p.graph("Decisions by event",
                "Decision lines per kind: preempt, admission_blocked, never_fits, resume, "
                "finish, abort, error. "
                "loki/queries.logql: decisions_by_event.",
                p.loki_q(logql("decisions_by_event"), "{{event}}")),
        p.graph("Preemptions by engine", "loki/queries.logql: preemptions_by_engine.",
                p.loki_q(logql("preemptions_by_engine"), ID), w=8),
        p.graph("Admissions blocked",
                "Nothing was admitted while requests waited and the head's upper bound on "
                "blocks exceeded the free ones (one line per episode, repeated every 10 s; its "
                "reason is the limit vLLM's waiting loop met first: preempted, token_budget, "
                "max_num_seqs or kv_blocks). "
                "loki/queries.logql: admissions_blocked.",
                p.loki_q(logql("admissions_blocked"), ID + " {{reason}}"), w=8),
        p.graph("Tokens thrown away by preemptions (1h)",
                "Computed tokens preemptions discarded per engine over the last hour (fewer "
                "are computed again on resume: what the prefix cache still holds is not). "
                "loki/queries.logql: discarded_tokens.",
                p.loki_q(logql("discarded_tokens"), ID), w=8),
    )
    b.row("Lines").add(
        p.grid("Most preempted requests (last hour)",
               "loki/queries.logql: top_victims. Click a request ID for its timeline.",
               p.loki_q(logql("top_victims"), "{{request_id}}", instant=True), w=8, h=10,
               links={"request_id": ("Timeline of ${__value.raw}", timeline)}),
        p.loglines("Preemptions",
                   "Every preemption line (msg: Preempting request <id> due to <reason> ...). "
                   "loki/queries.logql: preemption_lines.",
                   p.loki_q(logql("preemption_lines")), w=16),
        p.loglines("Preempted while blocks were free",
                   "Preemptions with free blocks left, for a known reason: the failed "
                   "allocation still needed more than were free (unknown-reason ones, such as "
                   "a prefix-cache reset, left out). "
                   "loki/queries.logql: preempted_with_free_blocks.",
                   p.loki_q(logql("preempted_with_free_blocks"))),
    )
    b.row("The same decisions in ClickHouse").add(p.grid(
        "Decisions by kind and reason (time range)",
        "scheduler_decisions in ClickHouse; its counts and Loki's should agree.",
        p.ch(sql.render("decisions_by_reason")), h=8))
    return b
