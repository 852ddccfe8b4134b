"""Times as users give them: epoch seconds or ISO 8601 (UTC when no zone is named)."""

from __future__ import annotations

import math
from datetime import datetime, timezone


def epoch_seconds(value: str | float) -> float:
    """``value`` as epoch seconds; ``ValueError`` when it is neither a finite number nor an
    ISO 8601 date-time."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        text = str(value).strip()
        try:
            number = float(text)
        except ValueError:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
            return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(number):
        raise ValueError(f"not a finite time: {value!r}")
    return number
