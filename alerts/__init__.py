"""kvscope's Prometheus rules: ``config`` (what to tune), rule modules, and ``generate``."""
