"""The families a scrape builds, from the declarations of ``kvscope.metric_table``.

``Families`` creates a family the first time a scrape names it (refusing a type or labels
other than the declared ones) and yields them in that order.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvscope.metric_table import BY_NAME, COUNTER, ENGINE, GAUGE, SIDECAR_METRICS, family

EL = list(ENGINE)
"""An engine's labels."""
DOCS = {m.name: m.help for m in SIDECAR_METRICS}
"""Each metric's help (the declarations are in ``kvscope.metric_table``)."""


class Families:
    """Creates families lazily and yields them in creation order."""

    def __init__(self) -> None:
        self.fams: dict[str, Metric] = {}

    def g(self, name: str, labels: list[str] = EL) -> GaugeMetricFamily:
        return self._get(name, GAUGE, labels)  # type: ignore[return-value]

    def c(self, name: str, labels: list[str] = EL) -> CounterMetricFamily:
        return self._get(name, COUNTER, labels)  # type: ignore[return-value]

    def _get(self, name: str, kind: str, labels: list[str]) -> Metric:
        fam = self.fams.get(name)
        if fam is None:
            declared = BY_NAME[name]
            if declared.kind != kind or list(declared.labels) != labels:
                raise ValueError(f"{name} is declared a {declared.kind} with labels "
                                 f"{declared.labels}, asked for as a {kind} with {labels}")
            fam = self.fams[name] = family(declared)
        return fam

