"""kvscope.state: the model of each engine the sidecar hears from, fed by ingest and read by
everything above it (exposition, HTTP, layout, twin, whatif).

It holds the hub of engines (``hub``), each engine's state (``engine``) with its rebuilt
block pool (``ledger``), liveness (``presence``), pool sizes (``capacity``), the request
tracker (``requests``, ``request_tables``, ``rollups``) and the client join (``clients``,
``client_stats``, ``hashkey``).

It may import only the probe's wire contract (``kvscope_probe``), the row types
(``kvscope.rows``) and the small shared helpers (``kvscope.times``, ``kvscope.errors``,
``kvscope.redact``); never a sink, the sidecar or anything above.
"""
