"""kvscope.sidecar.http: the FastAPI app (``app``), ``/healthz`` (``health``),
``/health/preempt-rate`` (``pressure``) and the request-body limit (``bodylimit``).

It may import ``kvscope.state``, ``kvscope.sidecar.ingest`` and ``kvscope.sidecar.exposition``.
"""
