"""PromQL the dashboards write more than once: sums of rates and of increases over the
panel's ``$__rate_interval``, with the dashboards' selector (``Config.sel``)."""

from __future__ import annotations

from dashboards.config import Config


def rate(cfg: Config, counter: str, by: str = "server, engine", *matchers: str,
         engine: bool = True) -> str:
    """``sum by (by) (rate(counter{selector}[$__rate_interval]))``; ``engine=False`` for
    series without the engine labels (the sidecar's own, the clients'), which are then
    those of the sidecars serving the selected engines (``Config.on_sidecars``)."""
    got = f"rate({cfg.m(counter, *matchers, engine=engine)}[$__rate_interval])"
    return f"sum by ({by}) ({got if engine else cfg.on_sidecars(got)})"


def increase(cfg: Config, counter: str) -> str:
    """Per engine, how much ``counter`` grew in each interval (a count that should stay 0)."""
    return f"sum by (server, engine) (increase({cfg.m(counter)}[$__rate_interval]))"
