"""PromQL and rule-building helpers shared by the recording and alerting rule modules."""

from __future__ import annotations

from typing import Any

from alerts.config import Config, Severity
from kvscope.metric_table import series

Rule = dict[str, Any]


class Promql:
    """Selector and grouping helpers bound to one Config."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.engine = ", ".join(cfg.engine_labels)

    def m(self, name: str, *matchers: str) -> str:
        """``name{selector, matchers...}``: a series of the sidecar's scrape job."""
        name = series(name)
        parts = [p for p in (self.cfg.selector, *matchers) if p]
        return f"{name}{{{', '.join(parts)}}}" if parts else name

    def by_engine(self, fn: str, inner: str) -> str:
        return f"{fn} by ({self.engine}) ({inner})"

    def increase(self, counter: str, window: str, by: str | None = None) -> str:
        """``sum by (engine labels, or by) (increase(counter[window]))``."""
        return f"sum by ({by or self.engine}) (increase({self.m(counter)}[{window}]))"

    def rate5m(self, counter: str, *extra_by: str) -> str:
        labels = ", ".join((*self.cfg.engine_labels, *extra_by))
        return f"sum by ({labels}) (rate({self.m(counter)}[5m]))"


def pct(x: float) -> str:
    """0.05 -> '5%' for static text (templates use humanizePercentage)."""
    return f"{x * 100:g}%"


def alert(
    cfg: Config,
    name: str,
    expr: str,
    *,
    severity: Severity,
    summary: str,
    description: str,
    dashboard: str,
    for_: str | None = None,
    per_engine: bool = True,
) -> Rule:
    """One alerting rule with kvscope's labels and annotations.

    ``per_engine`` alerts link their dashboard with ``var-server`` and ``var-engine`` set
    to the engine's.
    """
    url = f"{cfg.grafana_url.rstrip('/')}/d/{dashboard}"
    if per_engine:
        url += "?var-server={{ $labels.server }}&var-engine={{ $labels.engine }}"
    rule: Rule = {"alert": name, "expr": expr}
    if for_:
        rule["for"] = for_
    rule["labels"] = {"severity": severity, "priority": cfg.priority(severity)}
    rule["annotations"] = {
        "summary": summary,
        "description": description,
        "runbook_url": f"{cfg.runbook_url}#{name.lower()}",
        "dashboard_url": url,
    }
    return rule
