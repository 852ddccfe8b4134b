"""Layer 4, scheduler decisions: one JSON line each (``log``), optionally pushed to Loki
(``loki``); ``logql`` checks the LogQL the dashboards and README use.

It may import ``kvscope.sinks``, ``kvscope.rows`` and the helpers; not the state or above.
"""
