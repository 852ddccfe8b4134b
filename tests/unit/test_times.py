"""kvscope.times: the one parser for times users give (layout history, what-if replays)."""

from __future__ import annotations

import pytest

from kvscope.times import epoch_seconds


@pytest.mark.parametrize(("value", "seconds"), [
    (1764547200, 1764547200.0),
    (1764547200.25, 1764547200.25),
    ("1764547200.5", 1764547200.5),
    (" 1764547200 ", 1764547200.0),
    ("2025-12-01T00:00:00Z", 1764547200.0),
    ("2025-12-01T00:00:00", 1764547200.0),  # no zone: UTC
    ("2025-12-01T01:00:00+01:00", 1764547200.0),
])
def test_epoch_seconds_or_iso(value: object, seconds: float) -> None:
    assert epoch_seconds(value) == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["nan", float("inf"), "-inf", True, "yesterday", "", [1]])
def test_anything_else_is_a_value_error(value: object) -> None:
    with pytest.raises(ValueError):
        epoch_seconds(value)  # type: ignore[arg-type]
