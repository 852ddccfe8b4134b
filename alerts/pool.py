"""Alerts on the KV block pool and the scheduler: what an operator of vLLM is paged for."""

from __future__ import annotations

from alerts.config import Config, Severity
from alerts.promql import Promql, Rule, alert, pct

ENGINE = "Engine {{ $labels.server }}/{{ $labels.engine }} ({{ $labels.model }})"


def exhausted_budget_left(cfg: Config) -> Rule:
    """The P1: preempted because the pool ran out, while the token budget had room."""
    q = Promql(cfg)
    preempted = q.by_engine(
        "sum", 'engine_reason:vllm_scheduler_preemptions:rate5m{reason!="unknown"}'
    )
    return alert(
        cfg,
        "KVScopeKVPoolExhaustedBudgetLeft",
        # $value is the first operand: the budget utilization the description quotes.
        "engine:vllm_scheduler_token_budget_utilization:ratio_rate5m"
        f" < {cfg.budget_left_below:g}\nand\n"
        "min_over_time(engine:vllm_scheduler_free_blocks:ratio[5m])"
        f" <= {cfg.exhausted_free_ratio:g}\nand\n"
        f"{preempted} > 0",
        severity="critical",
        for_=cfg.exhausted_for,
        summary="The KV block pool is exhausted and requests are preempted while the "
        "token budget has room.",
        description=f"{ENGINE} preempted requests in the last 5 minutes because its KV "
        f"block pool ran out (free blocks at or below {pct(cfg.exhausted_free_ratio)} of "
        "the pool), while only {{ $value | humanizePercentage }} of its token budget was "
        "used. KV memory, not the per-step token budget, is the limit: raising "
        "--max-num-batched-tokens will not help.",
        dashboard=cfg.dashboards.blocks,
    )


def preemption_rate(cfg: Config) -> list[Rule]:
    """Preemptions per ended request over 5 minutes: a warning and a sustained critical."""
    rules = []
    levels: tuple[tuple[Severity, float, str], ...] = (
        ("warning", cfg.preemption_rate_warning, cfg.preemption_warning_for),
        ("critical", cfg.preemption_rate_critical, cfg.preemption_critical_for),
    )
    for severity, threshold, for_ in levels:
        rules.append(
            alert(
                cfg,
                "KVScopePreemptionRateHigh",
                "engine:vllm_scheduler_preemptions_per_request:ratio_rate5m"
                f" > {threshold:g}\nand\n"
                f"engine:vllm_scheduler_preemptions:rate5m * 300 >= {cfg.preemption_min_5m}",
                severity=severity,
                for_=for_,
                summary=f"Preemptions exceed {pct(threshold)} of the requests that end.",
                description=f"{ENGINE}: preemptions amounted to "
                "{{ $value | humanizePercentage }} of the requests that ended over the last 5 "
                f"minutes (threshold {pct(threshold)}, sustained for {for_}). Each preemption "
                "frees the victim's KV blocks; what the prefix cache no longer holds is "
                "computed again when the request resumes.",
                dashboard=cfg.dashboards.requests,
            )
        )
    return rules


def admission_blocked(cfg: Config) -> Rule:
    q = Promql(cfg)
    return alert(
        cfg,
        "KVScopeAdmissionBlocked",
        f"{q.by_engine('sum', q.m('vllm_scheduler_waiting_head_blocks_needed'))}\n-\n"
        f"{q.by_engine('sum', q.m('vllm_scheduler_admission_free_blocks'))}\n> 0\nand\n"
        f"{q.by_engine('sum', q.m('vllm_scheduler_waiting_requests'))} > 0\nunless\n"
        f"{never_fits_expr(q)}",
        severity="warning",
        for_=cfg.admission_blocked_for,
        summary="The head of the waiting queue may need more KV blocks than are free; "
        "while it does, no waiting request is admitted.",
        description=f"{ENGINE}: the request at the head of the waiting queue needs up to "
        "{{ $value }} more KV blocks than the pool has free for it, and has for at least "
        f"{cfg.admission_blocked_for} (an upper bound: its whole sequence in every KV cache "
        "group, before prefix-cache hits; loose on hybrid models, whose sliding-window and "
        "Mamba groups hold fewer blocks; evictable cached blocks count as free, less the "
        "--watermark reserve vLLM keeps from waiting requests while any runs). vLLM "
        "admits waiting requests in order: while the head cannot be admitted, every "
        "request behind it waits too. The decision log's admission_blocked lines say "
        "whether anything was admitted and which limit held.",
        dashboard=cfg.dashboards.decisions,
    )


def never_fits_expr(q: Promql) -> str:
    return f"{q.by_engine('max', q.m('vllm_scheduler_waiting_head_never_fits'))} == 1"


def never_fits(cfg: Config) -> Rule:
    """A head that needs more blocks than the whole pool: no freed block will admit it."""
    q = Promql(cfg)
    return alert(
        cfg,
        "KVScopeRequestNeverFits",
        never_fits_expr(q),
        severity="critical",
        for_=cfg.never_fits_for,
        summary="The request at the head of the waiting queue needs more KV blocks than the "
        "whole pool holds: it can never be admitted.",
        description=f"{ENGINE}: the request at the head of the waiting queue needs more "
        "KV blocks than the pool's usable blocks, even with every running request done, "
        f"and has for at least {cfg.never_fits_for}. vLLM admits waiting requests in "
        "order, so it and every request behind it wait until it is aborted. The decision "
        "log's never_fits line names the request and its blocks.",
        dashboard=cfg.dashboards.decisions,
    )


def contiguity(cfg: Config) -> Rule:
    """The field's rule, kept because operators use it, described truthfully."""
    q = Promql(cfg)
    return alert(
        cfg,
        "KVScopeContiguousFreeBlocksLow",
        f"{q.m('vllm_scheduler_max_contiguous_free_blocks')}"
        f" < {cfg.contiguity_max_run_below}\nand\n"
        f"{q.m('vllm_scheduler_token_budget_utilization')} > {cfg.contiguity_budget_above:g}",
        severity=cfg.contiguity_severity,
        for_=cfg.contiguity_for,
        summary="The longest run of consecutive free KV block IDs is short while the token "
        "budget is busy.",
        description=f"{ENGINE}: the longest run of consecutive free KV block IDs is "
        f"{{{{ $value }}}} blocks (below {cfg.contiguity_max_run_below}) while more than "
        f"{pct(cfg.contiguity_budget_above)} of the token budget is used. On vLLM V1 this "
        "neither causes preemptions nor blocks admission: allocation takes any free "
        "blocks and never needs contiguous IDs. It matters only where KV blocks are "
        "copied out (KV offload, disaggregated prefill), where scattered blocks mean more "
        "transfer descriptors.",
        dashboard=cfg.dashboards.layout,
    )


def pool_alerts(cfg: Config) -> list[Rule]:
    return [
        exhausted_budget_left(cfg),
        *preemption_rate(cfg),
        admission_blocked(cfg),
        never_fits(cfg),
        contiguity(cfg),
    ]
