"""Fleet recording rules: the engine rules summed per model, per vLLM server and fleet-wide.

A fleet dashboard reads these (seven per model, per server and for the fleet) instead of
every engine's; they read three rules of the ``kvscope.rules`` group; the alerts keep
reading the ``engine:`` series, so a page still names one engine. Each level is named for
the labels it keeps (``model:``, ``server:``, ``fleet:`` for none), plus ``_reason`` or
``_state`` where that label stays. Ratios are sums over sums, never means of ratios: a
fleet's free fraction is its free blocks over its blocks, not the average engine's.
"""

from __future__ import annotations

from alerts.config import Config
from alerts.promql import Promql, Rule

LEVELS = (("model", "model"), ("server", "server"), ("fleet", ""))
"""Level name -> the labels it keeps (none: the whole fleet)."""


def _by(keep: str, *extra: str) -> str:
    labels = ", ".join(x for x in (keep, *extra) if x)
    return f"sum by ({labels})" if labels else "sum"


def _level(name: str, keep: str, q: Promql) -> list[tuple[str, str]]:
    s = _by(keep)
    return [
        (f"{name}:vllm_scheduler_free_blocks:ratio",
         f"{s} ({q.m('vllm_scheduler_free_blocks')})\n/\n"
         f"({s} ({q.m('vllm_scheduler_total_blocks')}) > 0)"),
        (f"{name}_reason:vllm_scheduler_preemptions:rate5m",
         f"{_by(keep, 'reason')} (engine_reason:vllm_scheduler_preemptions:rate5m)"),
        (f"{name}:vllm_scheduler_preemptions:rate5m",
         f"{s} (engine:vllm_scheduler_preemptions:rate5m)"),
        # Unfilled slots over the slots of used blocks, each engine's weighted by its used
        # blocks (exact where the engines summed share a block size, as one model's do).
        (f"{name}:vllm_scheduler_tail_waste:ratio",
         f"{s} (engine:vllm_scheduler_tail_waste:ratio * "
         f"{q.by_engine('sum', q.m('vllm_scheduler_used_blocks'))})\n/\n"
         f"({s} ({q.m('vllm_scheduler_used_blocks')}) > 0)"),
        (f"{name}:vllm_scheduler_waiting_head_never_fits:sum",
         f"{s} ({q.m('vllm_scheduler_waiting_head_never_fits')})"),
        (f"{name}_state:kvscope_probe_state:sum",
         f"{_by(keep, 'state')} ({q.m('kvscope_probe_state')})"),
        (f"{name}:vllm_scheduler_recomputed_tokens:ratio_rate5m",
         f"{s} (engine:vllm_scheduler_recomputed_tokens:rate5m)\n/\n"
         f"({s} (rate({q.m('vllm_scheduler_scheduled_tokens_total')}[5m])) > 0)"),
    ]


def fleet_rules(cfg: Config) -> list[Rule]:
    """Per-engine inputs the levels share, then each level; later rules use earlier ones."""
    q = Promql(cfg)
    engine = [
        ("engine:vllm_scheduler_tail_waste:ratio",
         f"1 - {q.by_engine('max', q.m('vllm_scheduler_kv_token_occupancy_ratio'))}"),
        # Of the tokens the engine scheduled, the share spent computing again what
        # preemptions discarded: the engine time its preemptions cost.
        ("engine:vllm_scheduler_recomputed_tokens:ratio_rate5m",
         "engine:vllm_scheduler_recomputed_tokens:rate5m\n/\n"
         f"({q.rate5m('vllm_scheduler_scheduled_tokens_total')} > 0)"),
    ]
    levels = [r for name, keep in LEVELS for r in _level(name, keep, q)]
    return [{"record": name, "expr": expr} for name, expr in engine + levels]
