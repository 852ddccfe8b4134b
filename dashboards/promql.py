"""PromQL the dashboards write more than once: sums of rates and of increases over the
panel's ``$__rate_interval``, with the dashboards' selector (``Config.sel``)."""

from __future__ import annotations

from dashboards.config import Config


def rate(cfg: Config, counter: str, by: str = "server, engine", *matchers: str,
         engine: bool = True) -> str:
    """``sum by (by) (rate(counter{selector}[$__rate_interval]))``; ``engine=False`` for
    series without the engine labels (the sidecar's own, the clients')."""
    sel = cfg.m(counter, *matchers, engine=engine)
    return f"sum by ({by}) (rate({sel}[$__rate_interval]))"


def increase(cfg: Config, counter: str) -> str:
    """Per engine, how much ``counter`` grew in each interval (a count that should stay 0)."""
    return f"sum by (server, engine) (increase({cfg.m(counter)}[$__rate_interval]))"
