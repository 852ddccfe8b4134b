"""kvscope.sinks: the one interface every store writes through (``base``), with queueing,
batching, spooling and retries (``delivery``, ``spool``) and their metrics; the stores
themselves live in ``kvscope.store`` (ClickHouse) and ``kvscope.decisions`` (log, Loki).

It may import ``kvscope.rows`` and the shared helpers; not the stores or anything above."""
