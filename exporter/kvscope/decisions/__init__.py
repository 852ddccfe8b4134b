"""Layer 4, scheduler decisions: one JSON line each (``log``), optionally pushed to Loki
(``loki``); ``logql`` checks the LogQL the dashboards and README use."""
