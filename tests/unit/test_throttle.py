"""The one log-throttle schedule, and that every repeating warning of the sidecar uses it."""

from __future__ import annotations

import re
from pathlib import Path

from kvscope.throttle import worth_logging

SRC = Path(__file__).resolve().parents[2] / "exporter" / "kvscope"


def test_logs_powers_of_ten_then_every_ten_thousandth() -> None:
    logged = [n for n in range(0, 50_001) if worth_logging(n)]
    assert logged == [1, 10, 100, 1000, 10_000, 20_000, 30_000, 40_000, 50_000]


def test_no_module_writes_its_own_schedule() -> None:
    """A hand-written ``in (1, 10, ...)`` or ``% 10000 == 0`` is a second schedule."""
    pattern = re.compile(r"in \(1, \d+|% ?10+ ?== ?0")
    own = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py"))
           if p.name != "throttle.py" and pattern.search(p.read_text())]
    assert own == []
