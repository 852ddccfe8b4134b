"""kvscope.sidecar.exposition: the ``/metrics`` collectors. ``metrics`` reads the state at
scrape time, ``metric_families`` names and explains every family, ``metrics_outside`` covers
what comes from outside the probe (NVML ``gpu``, the engine's ``process``, vLLM's own
``/metrics`` through ``vllm_metrics``).

It may import ``kvscope.state`` and ``kvscope.sidecar.ingest`` (for their counters); not HTTP.
"""
