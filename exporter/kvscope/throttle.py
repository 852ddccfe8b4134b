"""One schedule for repeated warnings: the 1st, 10th, 100th and 1000th of a kind, then every
10000th, so a fault that repeats a million times costs a few hundred lines, not a million,
and its count in the line says how often it happened. The counters themselves are exported
as metrics; the log only says that it is happening."""

from __future__ import annotations

EVERY = 10_000
"""After the first thousand, one line per this many."""


def worth_logging(count: int) -> bool:
    """True when the ``count``-th occurrence (1-based) of one kind of event gets a log line."""
    return count in (1, 10, 100, 1000) or (count > 0 and count % EVERY == 0)
