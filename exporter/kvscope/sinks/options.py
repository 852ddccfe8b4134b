"""How a sink's rows are batched, spooled and retried: ``DeliveryOptions`` (validated with
the rest of serve's configuration) and the retry ``Backoff``."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvscope.sinks.spool import FullPolicy


@dataclass(frozen=True)
class DeliveryOptions:
    batch_rows: int = 10_000
    """Seal a table's batch at this many rows."""
    batch_interval_s: float = 1.0
    """...or when its first row is this old."""
    insert_interval_s: float = 0.0
    """A table's spooled batches wait until the oldest one's first row is this old and go
    to the store as one insert (where the sink can combine them); 0: each batch as soon as
    it is spooled."""
    max_queue_rows: int = 200_000
    """Rows of one table held in memory before they reach the spool; more are dropped and
    counted (only when the disk cannot keep up)."""
    spool_max_bytes: int = 256 << 20
    """Bound of the on-disk spool."""
    spool_policy: FullPolicy = "drop_oldest"
    """What a full spool gives up: its oldest batch, or the incoming one."""
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 30.0
    fsync: bool = True
    """fsync each spooled batch (off only for benchmarks and tests)."""
    check_interval_s: float = 30.0
    """While no batch is waiting, look at the store this often (and once at start), so that
    ``connected`` says how the store is on an idle night too."""

    def validate(self) -> list[str]:
        errors = []
        if self.batch_rows < 1:
            errors.append("batch_rows must be at least 1")
        if self.batch_interval_s <= 0:
            errors.append("batch_interval_s must be positive")
        if self.insert_interval_s < 0:
            errors.append("insert_interval_s must not be negative")
        if self.max_queue_rows < self.batch_rows:
            errors.append("max_queue_rows must be at least batch_rows")
        if self.spool_max_bytes < 1 << 16:
            errors.append("spool_max_bytes must be at least 64 KiB")
        if self.spool_policy not in ("drop_oldest", "drop_newest"):
            errors.append("spool_policy must be drop_oldest or drop_newest")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            errors.append("backoff must satisfy 0 < initial <= max")
        if self.check_interval_s <= 0:
            errors.append("check_interval_s must be positive")
        return errors


class Backoff:
    """Exponential backoff with jitter (half to full of the step)."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s, self.n = initial_s, max_s, 0

    def next(self) -> float:
        step = min(self.max_s, self.initial_s * 2 ** min(self.n, 30))
        self.n += 1
        return step * (0.5 + random.random() / 2)

    def reset(self) -> None:
        self.n = 0
