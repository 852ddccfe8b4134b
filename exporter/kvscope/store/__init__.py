"""Layer 2, ClickHouse: the schema (``clickhouse/schema/*.sql``, applied by ``schema``), the
sink that writes the rows of ``kvscope.rows`` (``sink``, encoded by ``arrow``, through
``kvscope.sinks.delivery``) and the saved queries (``clickhouse/queries``, run by ``query``),
both connecting through ``embedded`` (which opens the embedded chDB store with its options).

It may import ``kvscope.rows``, ``kvscope.sinks`` and the shared helpers; not the state,
the sidecar or anything above."""

SINK_NAME = "clickhouse"
"""The ClickHouse sink's name: its ``sink`` label on ``kvscope_sink_*`` (here, so a reader
of those metrics, such as the demo, need not import the sink and its clients)."""
