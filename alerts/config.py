"""Everything an operator tunes in kvscope's alerts: selectors, thresholds, URLs, dashboard UIDs.

``alerts.generate`` renders ``kvscope.rules.yml`` from one ``Config``. Change a value
here (or build a ``Config(...)`` of your own and call ``alerts.rules.build``), regenerate,
and commit both; ``tests/stack/test_rules.py`` fails while the YAML and this file disagree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Literal

Severity = Literal["critical", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("critical", "warning", "info")

_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


@dataclass(frozen=True)
class Dashboards:
    """Grafana dashboard UIDs the alerts link to (the dashboards are built elsewhere)."""

    blocks: str = "kvscope-blocks"
    """Layer 1: budget vs blocks, the pool over time, and kvscope's own health."""
    requests: str = "kvscope-requests"
    """Layer 2: per-request traces, preemptions per request."""
    layout: str = "kvscope-layout"
    """Layer 3: block ID x time heatmap, free runs."""
    decisions: str = "kvscope-decisions"
    """Layer 4: the decision log (preempt, admission blocked, resume)."""
    clients: str = "kvscope-clients"
    """Layer 5: preemptions by client."""
    fleet: str = "kvscope-fleet"
    """Every engine at once: the fleet rules, the worst engines, silent probes."""


@dataclass(frozen=True)
class Config:
    """Selectors, thresholds and links of every kvscope rule."""

    selector: str = 'job="kvscope"'
    """Label matchers that pick the sidecar's series (also used on ``up``)."""
    engine_labels: tuple[str, ...] = ("job", "instance", "server", "engine", "model")
    """Labels that identify one engine (its vLLM server and vLLM's engine label, the DP
    index); recording rules aggregate to exactly these."""
    sidecar_labels: tuple[str, ...] = ("job", "instance")
    """Labels that identify one sidecar (for its receiver and sink series)."""
    grafana_url: str = "http://localhost:3000"
    """Base URL of Grafana; ``dashboard_url`` is ``{grafana_url}/d/{uid}``."""
    runbook_url: str = "https://github.com/kvscope/kvscope/blob/main/alerts/runbook.md"
    """The rendered ``alerts/runbook.md``; ``runbook_url`` is ``{this}#{alertname lowercased}``."""
    dashboards: Dashboards = field(default_factory=Dashboards)
    priorities: tuple[tuple[Severity, str], ...] = (
        ("critical", "P1"),
        ("warning", "P2"),
        ("info", "P3"),
    )
    """The ``priority`` label each severity carries."""

    # -- KVScopeKVPoolExhaustedBudgetLeft (the P1 page) --------------------------------
    exhausted_free_ratio: float = 0.05
    """The pool counts as exhausted when free / usable blocks fell to this or below at some
    scrape of the last 5 minutes. Not 0: the gauge is sampled at scrape time, and a
    saturated pool jumps back up each time a victim's blocks are freed, so it seldom shows
    exactly 0 free at a scrape (the preemptions prove the shortage; this confirms it)."""
    budget_left_below: float = 0.5
    """... while scheduled / budget tokens over 5 minutes stayed below this."""
    exhausted_for: str = "5m"

    # -- KVScopePreemptionRateHigh -------------------------------------------------------
    preemption_rate_warning: float = 0.05
    """Preemptions per request that ended, over 5 minutes (see the runbook)."""
    preemption_rate_critical: float = 0.10
    preemption_min_5m: int = 3
    """Fewer preemptions than this in 5 minutes never fire (a quiet engine's ratio is noise)."""
    preemption_warning_for: str = "10m"
    preemption_critical_for: str = "15m"

    # -- KVScopeAdmissionBlocked --------------------------------------------------------
    admission_blocked_for: str = "5m"

    # -- KVScopeRequestNeverFits ---------------------------------------------------------
    never_fits_for: str = "1m"
    """The gauge is exact (never 1 for a head that could fit), and such a head waits for
    good: this only rides out one scrape."""

    # -- KVScopeContiguousFreeBlocksLow (the field's rule, kept for operators) ------------
    contiguity_max_run_below: int = 100
    contiguity_budget_above: float = 0.6
    contiguity_severity: Severity = "info"
    """Info by default: on vLLM V1 contiguity never causes a preemption."""
    contiguity_for: str = "5m"

    # -- kvscope's own health -------------------------------------------------------------
    probe_silent_for: str = "5m"
    """After the sidecar's --health-timeout made a probe silent (no record, no heartbeat)."""
    engine_gone_for: str = "1m"
    """How long an engine process the sidecar saw exit stays unreplaced before it alerts."""
    engine_stalled_for: str = "5m"
    """A probe that heartbeats but reports no step while its last step left work."""
    probe_problem_window: str = "10m"
    """Window of increase() for dropped records, probe faults, rejected frames, mismatches."""
    probe_dropped_for: str = "5m"
    ledger_stale_for: str = "10m"
    frames_rejected_for: str = "5m"
    sidecar_down_for: str = "5m"
    reconciliation_window: str = "15m"
    """kvscope's and vLLM's preemption counts must not disagree in one direction this long."""
    sink_errors_for: str = "15m"
    sink_spool_window: str = "15m"
    """Window of deriv() on the spool size."""
    sink_unsent_age_s: int = 600
    """A growing spool alerts only once its oldest unsent row is older than this."""
    sink_spool_for: str = "15m"
    sink_dropped_window: str = "10m"
    """A sink that dropped any row within this window alerts."""
    sidecar_cpu_cores: float = 0.5
    """The sidecar's own CPU (every thread) above which it alerts: five times what eight
    busy engines cost it (issue 25's target of a tenth of a core, benchmarks/README.md)."""
    sidecar_cpu_window: str = "15m"
    """Window of rate() on its CPU, and how long it must stay above."""

    def priority(self, severity: Severity) -> str:
        return dict(self.priorities)[severity]

    def validate(self) -> list[str]:
        """Every problem with this config, one sentence each; empty when it is usable."""
        errors: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith(("_for", "_window")) and not _DURATION.match(str(value)):
                errors.append(f"{f.name} must be a Prometheus duration such as 5m, got {value!r}.")
        for name in ("exhausted_free_ratio", "budget_left_below", "contiguity_budget_above"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                errors.append(f"{name} must be between 0 and 1, got {value}.")
        if not 0 < self.preemption_rate_warning < self.preemption_rate_critical:
            errors.append(
                "preemption_rate_warning must be above 0 and below preemption_rate_critical, "
                f"got {self.preemption_rate_warning} and {self.preemption_rate_critical}."
            )
        if self.contiguity_severity not in SEVERITIES:
            errors.append(
                f"contiguity_severity must be one of {', '.join(SEVERITIES)}, "
                f"got {self.contiguity_severity!r}."
            )
        if {s for s, _ in self.priorities} != set(SEVERITIES):
            errors.append(f"priorities must name a priority for each of {', '.join(SEVERITIES)}.")
        for name in ("engine_labels", "sidecar_labels"):
            if not getattr(self, name):
                errors.append(f"{name} must not be empty.")
        if not {"server", "engine", "model"} <= set(self.engine_labels):
            errors.append("engine_labels must include server, engine and model (descriptions "
                          "name them).")
        for name in ("grafana_url", "runbook_url"):
            if not str(getattr(self, name)).startswith(("http://", "https://")):
                errors.append(f"{name} must be an http(s) URL, got {getattr(self, name)!r}.")
        return errors
