"""What the dashboards share: UIDs (the alerts' own), the scrape selector, datasources.

The UIDs and the selector come from ``alerts.config`` so that every alert's
``dashboard_url`` resolves to a dashboard built here and both read the same series.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from alerts.config import Config as AlertsConfig
from alerts.config import Dashboards
from kvscope.metric_table import series

ENGINE_METRIC = "vllm_scheduler_running_requests"
"""Exported for probe-fed and coarse (vLLM /metrics only) engines alike: the series the
engine variables and the sidecar scoping read."""

CLICKHOUSE_TYPE = "grafana-clickhouse-datasource"
"""Plugin ID of Grafana's official ClickHouse datasource (v4 query model)."""
CLICKHOUSE_PLUGIN_VERSION = "4.5.1"
"""The plugin version the targets are written for; docker-compose.yml installs this one."""


@dataclass(frozen=True)
class Config:
    """Everything the dashboard builders take."""

    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    """Thresholds drawn on panels are the alerts' own."""
    tags: tuple[str, ...] = ("kvscope",)
    """Every dashboard carries these; the dashboard links list dashboards by them."""
    refresh: str = "30s"
    time_from: str = "now-1h"

    @property
    def uids(self) -> Dashboards:
        return self.alerts.dashboards

    @property
    def job(self) -> str:
        """The sidecar's scrape selector, as the alerts use it (``job="kvscope"``)."""
        return self.alerts.selector

    def sel(self, *matchers: str, engine: bool = True) -> str:
        """``{job="kvscope", server=~"$server", engine=~"$engine", model=~"$model",
        matchers...}``."""
        parts = [self.job]
        if engine:
            parts += ['server=~"$server"', 'engine=~"$engine"', 'model=~"$model"']
        return "{" + ", ".join([*parts, *matchers]) + "}"

    def m(self, metric: str, *matchers: str, engine: bool = True) -> str:
        return series(metric) + self.sel(*matchers, engine=engine)

    def on_sidecars(self, expr: str) -> str:
        """``expr``, a sidecar's own series (no engine labels: sinks, receiver, clients,
        GPUs), kept only for the sidecars that serve the selected engines: one scrape
        target exports both, so they share ``instance``. Without it a per-engine panel
        summed every sidecar of the fleet (1,000 spool series for one engine picked)."""
        engines = self.m(ENGINE_METRIC)
        return f"({expr} and on(instance) {engines})"
