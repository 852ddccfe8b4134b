"""Builds kvscope's rule groups (plain dicts, ready for YAML) from one ``Config``.

Recording rules are named ``level:metric:operation``: ``engine:`` series carry exactly
``Config.engine_labels``, so alerts can join them with plain ``and``.
"""

from __future__ import annotations

from typing import Any

from alerts.config import Config
from alerts.fleet import fleet_rules
from alerts.health import health_alerts
from alerts.pool import pool_alerts
from alerts.promql import Promql, Rule

ENDS_OFF = 'feature="ends"'
"""The probe's ``ends`` hook off: the engine counts no ended request."""


def recording_rules(cfg: Config) -> list[Rule]:
    """Rates and ratios the alerts and dashboards share; order matters (later use earlier)."""
    q = Promql(cfg)
    gpu = ", ".join((*cfg.sidecar_labels, "gpu", "name"))
    sink = ", ".join((*cfg.sidecar_labels, "sink"))
    rec = [
        (
            "engine:vllm_scheduler_token_budget_utilization:ratio_rate5m",
            # Exact over the window, unlike the 10 s gauge; absent while the engine idles.
            f"{q.rate5m('vllm_scheduler_scheduled_tokens_total')}\n/\n"
            f"({q.rate5m('vllm_scheduler_token_budget_tokens_total')} > 0)",
        ),
        (
            "engine_reason:vllm_scheduler_preemptions:rate5m",
            q.rate5m("vllm_scheduler_preempted_requests_total", "reason"),
        ),
        ("engine:vllm_scheduler_preemptions:rate5m",
         q.rate5m("vllm_scheduler_preempted_requests_total")),
        ("engine:vllm_scheduler_requests_arrived:rate5m",
         q.rate5m("vllm_scheduler_requests_arrived_total")),
        ("engine:vllm_scheduler_requests_ended:rate5m",
         q.rate5m("vllm_scheduler_requests_ended_total")),
        (
            "engine:vllm_scheduler_preemptions_per_request:ratio_rate5m",
            # Preemptions per request that ended. Before any request has ended the
            # denominator series is absent: count it as 0, so a thrashing engine shows +Inf;
            # but not where no ended request is ever counted (an engine seen only through
            # vLLM's /metrics, a probe whose `ends` hook is off): its rate is unknown.
            "engine:vllm_scheduler_preemptions:rate5m\n/\n(\n"
            "  engine:vllm_scheduler_requests_ended:rate5m\n  or\n"
            "  (\n    engine:vllm_scheduler_preemptions:rate5m * 0\n"
            f"    unless on ({q.engine}) {q.m('kvscope_engine_coarse')}\n"
            f"    unless on ({q.engine}) {q.m('kvscope_probe_feature_disabled', ENDS_OFF)}"
            "\n  )\n)",
        ),
        (
            "engine:vllm_scheduler_free_blocks:ratio",
            f"sum by ({q.engine}) ({q.m('vllm_scheduler_free_blocks')})\n/\n"
            f"(sum by ({q.engine}) ({q.m('vllm_scheduler_total_blocks')}) > 0)",
        ),
        ("engine:vllm_scheduler_preempted_tokens:rate5m",
         q.rate5m("vllm_scheduler_preempted_tokens_total")),
        ("engine:vllm_scheduler_recomputed_tokens:rate5m",
         q.rate5m("vllm_scheduler_recomputed_tokens_total")),
        (
            "engine:kvscope_probe_overhead:ratio_rate5m",
            f"{q.rate5m('kvscope_probe_overhead_seconds_total')}\n/\n"
            f"({q.rate5m('kvscope_engine_schedule_seconds_total')} > 0)",
        ),
        (
            "instance_gpu:kvscope_gpu_memory_used:ratio",
            f"sum by ({gpu}) ({q.m('kvscope_gpu_memory_used_bytes')})\n/\n"
            f"(sum by ({gpu}) ({q.m('kvscope_gpu_memory_total_bytes')}) > 0)",
        ),
        (
            "sink:kvscope_sink_rows_written:rate5m",
            f"sum by ({sink}) (rate({q.m('kvscope_sink_rows_written_total')}[5m]))",
        ),
    ]
    return [{"record": name, "expr": expr} for name, expr in rec]


def build(cfg: Config | None = None) -> dict[str, Any]:
    """The whole rule file as a dict; raises ValueError listing every config problem."""
    cfg = cfg or Config()
    errors = cfg.validate()
    if errors:
        raise ValueError("invalid alerts Config: " + " ".join(errors))
    return {
        "groups": [
            {"name": "kvscope.rules", "rules": recording_rules(cfg)},
            # Its own group: a global Prometheus (or Thanos ruler) can run it alone.
            {"name": "kvscope-fleet", "rules": fleet_rules(cfg)},
            {"name": "kvscope-pool", "rules": pool_alerts(cfg)},
            {"name": "kvscope-health", "rules": health_alerts(cfg)},
        ]
    }
