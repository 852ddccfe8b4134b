"""Layer 3, the block layout: each engine's pool as run-length-encoded snapshots.

``snapshot`` encodes one pool; ``sampler`` keeps recent ones in memory; ``history`` writes
them to ClickHouse and reads older ones back; ``api`` serves ``/api/layout`` and the
``/ui`` page (``ui/index.html``, shapes in ``layout.schema.json``); ``dump`` and ``png``
are ``kvscope layout dump``; ``palette`` colours both views.

It may import ``kvscope.state``, ``kvscope.rows`` and the helpers; never the sidecar, which
imports it to sample and serve the layout.
"""
