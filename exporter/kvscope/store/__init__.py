"""Layer 2, ClickHouse: the schema (``clickhouse/schema/*.sql``, applied by ``schema``), the
rows (``rows``, encoded by ``arrow``), the sink that writes them (``sink``, through
``kvscope.sinks.delivery``) and the saved queries (``clickhouse/queries``, run by ``query``)."""
