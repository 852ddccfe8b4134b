"""Layer 5, clients: who gets preempted (kvscope_client_* metrics from the middleware's
events joined to engine traces) and who resubmits (client_requests in ClickHouse).
"""

from __future__ import annotations

from typing import Any

from dashboards import clickhouse as sql
from dashboards import panels as p
from dashboards.blocks import engine_variables
from dashboards.config import Config
from dashboards.panels import ID
from dashboards.promql import rate

CLIENT = 'client=~"$client"'


def client_rate(cfg: Config, counter: str, by: str, *matchers: str) -> str:
    """A rate of the client series, which carry no engine labels."""
    return rate(cfg, counter, by, *matchers, engine=False)


def ratio(cfg: Config, num: str, den: str, by: str, *matchers: str) -> str:
    """``rate(num) / (rate(den) > 0)`` summed by ``by``: no NaN while nothing was answered."""
    return (f"{client_rate(cfg, num, by, *matchers)}\n/\n"
            f"({client_rate(cfg, den, by, *matchers)} > 0)")


def build(cfg: Config) -> p.Board:
    b = p.Board(cfg, cfg.uids.clients, "kvscope / Clients",
                "Preemptions by client and user agent, duplicate submissions and retry storms.")
    b.variables(*variables(cfg))
    b.row("Preemptions by client").add(*preemptions_by_client(cfg))
    b.row("Traffic and duplicates").add(*traffic_and_duplicates(cfg))
    b.row("client_requests (ClickHouse)").add(*client_requests(cfg))
    return b


def variables(cfg: Config) -> list[Any]:
    """Datasources, the engine, the client, and the window and length of the top lists."""
    return [
        p.datasource("prometheus", "Prometheus"),
        p.datasource("clickhouse", "ClickHouse"),
        *engine_variables(cfg),
        p.label_values("client", "Client", cfg.m("kvscope_client_requests_total", engine=False),
                       description="Client ID header, else a hash of the API key, else "
                       "anonymous (the first 50 distinct values; the rest are 'other')."),
        p.custom("days", "Days", ["1", "7", "30", "90"],
                 sql.load("client_preemption_rate").defaults["days"],
                 "Window of the ClickHouse tables, in days back from now."),
        p.custom("limit", "Rows", ["10", "20", "50", "100"],
                 sql.load("client_duplicates").defaults["limit"], "Rows of the top lists."),
    ]


def preemptions_by_client(cfg: Config) -> list[p.Panel]:
    """Who gets preempted: per client, per user agent, against the engine-wide ratio."""
    return [
        p.graph("Preemptions per request, by client",
                "Preemptions of a client's engine requests / its API requests answered.",
                p.prom(ratio(cfg, "kvscope_client_preemptions_total",
                             "kvscope_client_requests_total", "client", CLIENT),
                       "{{client}}")),
        p.graph("Share of requests preempted, by client",
                "Engine requests preempted at least once / API requests answered.",
                p.prom(ratio(cfg, "kvscope_client_preempted_requests_total",
                             "kvscope_client_requests_total", "client", CLIENT),
                       "{{client}}"),
                unit="percentunit", minimum=0),
        p.graph("Preemptions per request, by user agent",
                "Preemptions / API requests per User-Agent (the first 20 distinct values).",
                p.prom(ratio(cfg, "kvscope_user_agent_preemptions_total",
                             "kvscope_user_agent_requests_total", "user_agent"),
                       "{{user_agent}}")),
        p.graph("Engine preemptions per request (for comparison)",
                "The engine-wide ratio the alerts watch: preemptions per ended request.",
                p.prom(cfg.m("engine:vllm_scheduler_preemptions_per_request:ratio_rate5m"),
                       ID),
                minimum=0),
    ]


def traffic_and_duplicates(cfg: Config) -> list[p.Panel]:
    """Who sends what: requests and duplicate submissions, and how events join traces."""
    return [
        p.graph("Requests by client", "API requests answered per second.",
                p.prom(client_rate(cfg, "kvscope_client_requests_total", "client", CLIENT),
                       "{{client}}"),
                unit="reqps", w=8),
        p.graph("Duplicate submissions by client",
                "Requests repeating the same client's prompt within the duplicate window: a "
                "rise with preemptions is a retry storm.",
                p.prom(client_rate(cfg, "kvscope_client_duplicate_requests_total", "client",
                                   CLIENT), "{{client}}"),
                unit="reqps", w=8),
        p.graph("Requests by user agent", "API requests answered per second.",
                p.prom(client_rate(cfg, "kvscope_user_agent_requests_total", "user_agent"),
                       "{{user_agent}}"),
                unit="reqps", w=8),
        p.graph("Joins of client events to traces",
                "Traces joined to a client event; middleware-tagged traces written without "
                "one (the event never arrived); label values refused a series.",
                p.prom(client_rate(cfg, "kvscope_client_traces_joined_total", "job"), "joined"),
                p.prom(client_rate(cfg, "kvscope_client_traces_unjoined_total", "job"), "unjoined"),
                p.prom("sum by (label) (" + cfg.on_sidecars(
                    f"rate({cfg.m('kvscope_client_label_overflow_total', engine=False)}"
                    "[$__rate_interval])") + ")", "overflow {{label}}"),
                unit="ops", w=24, h=6),
    ]


def client_requests(cfg: Config) -> list[p.Panel]:
    """The client_requests table in ClickHouse: top lists and requests over time."""
    return [
        p.grid("Preemption rate by client and user agent (last $days days)",
               "One row per client ID and User-Agent; preemption_rate is over the requests "
               "joined to engine traces.",
               p.ch(sql.render("client_preemption_rate")), h=9,
               units={"preemption_rate": "percentunit", "error_rate": "percentunit",
                      "avg_duration_s": "s"}),
        p.grid("Duplicate submissions (last $days days)",
               "Same client, same prompt hash, flagged duplicate by the middleware's window.",
               p.ch(sql.render("client_duplicates")), w=12, h=9, units={"span_s": "s"}),
        p.graph("Requests, preempted and duplicates per client over time",
                "client_requests bucketed by the panel's interval.",
                p.ch(sql.render("client_requests_over_time", bucket_s="$__interval_s"),
                     time_series=True),
                h=9),
    ]
