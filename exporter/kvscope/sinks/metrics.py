"""Prometheus view of kvscope's own sinks: rows written and dropped, errors, spool.

A collector over sink objects (anything with ``name`` and ``stats() -> SinkStats``; others
are skipped), read fresh at each scrape. Give it a list of sinks or the SinkManager itself,
so sinks added later are seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import Metric

from kvscope.metric_table import BY_NAME, SINK_METRICS, family


class SinkCollector:
    def __init__(self, sinks: Iterable[Any]) -> None:
        self._sinks = sinks

    def _each(self) -> Iterator[tuple[str, Any]]:
        sinks = getattr(self._sinks, "sinks", self._sinks)  # a SinkManager or a list
        for sink in list(sinks):
            if callable(getattr(sink, "stats", None)):
                yield sink.name, sink.stats()

    def describe(self) -> Iterator[Metric]:
        """The declared families, so a registry refuses a second collector of one name."""
        return (family(m) for m in SINK_METRICS)

    def collect(self) -> Iterator[Metric]:
        written, dropped, errors, spool, age, up = (family(BY_NAME[f"kvscope_sink_{n}"]) for n in (
            "rows_written", "rows_dropped", "errors", "spool_bytes",
            "oldest_unsent_age_seconds", "connected"))
        for name, st in self._each():
            for table, n in sorted(st.rows_written.items()):
                written.add_metric([name, table], n)
            for table, n in sorted(st.rows_dropped.items()):
                dropped.add_metric([name, table], n)
            errors.add_metric([name], st.errors)
            spool.add_metric([name], st.spool_bytes)
            age.add_metric([name], st.oldest_unsent_age_seconds)
            up.add_metric([name], 1.0 if st.connected else 0.0)
        yield from (written, dropped, errors, spool, age, up)
