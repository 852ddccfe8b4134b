"""Prometheus view of kvscope's own sinks: rows written and dropped, errors, spool.

A collector over sink objects (anything with ``name`` and ``stats() -> SinkStats``; others
are skipped), read fresh at each scrape. Give it a list of sinks or the SinkManager itself,
so sinks added later are seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class SinkCollector:
    def __init__(self, sinks: Iterable[Any]) -> None:
        self._sinks = sinks

    def _each(self) -> Iterator[tuple[str, Any]]:
        sinks = getattr(self._sinks, "sinks", self._sinks)  # a SinkManager or a list
        for sink in list(sinks):
            if callable(getattr(sink, "stats", None)):
                yield sink.name, sink.stats()

    def collect(self) -> Iterator[Metric]:
        written = CounterMetricFamily(
            "kvscope_sink_rows_written", "Rows a sink's store acknowledged.",
            labels=["sink", "table"])
        dropped = CounterMetricFamily(
            "kvscope_sink_rows_dropped",
            "Rows a sink gave up: memory queue overflow, full spool, or a batch the store "
            "refused for good.", labels=["sink", "table"])
        errors = CounterMetricFamily(
            "kvscope_sink_errors", "Failed attempts to spool or deliver a batch.",
            labels=["sink"])
        spool = GaugeMetricFamily(
            "kvscope_sink_spool_bytes", "Bytes of batches waiting in a sink's on-disk spool.",
            labels=["sink"])
        age = GaugeMetricFamily(
            "kvscope_sink_oldest_unsent_age_seconds",
            "Age of the oldest row a sink took but its store has not acknowledged (0: none).",
            labels=["sink"])
        up = GaugeMetricFamily(
            "kvscope_sink_connected", "1 when a sink's last delivery attempt succeeded.",
            labels=["sink"])
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
