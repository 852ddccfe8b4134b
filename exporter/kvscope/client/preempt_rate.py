"""The sidecar's ``/health/preempt-rate``: parse it, and decide when to poll it again.

This is the only preemption signal a client has today. It is server-wide (all engines,
all clients) and lags by up to the sidecar's window: it tells a client that the server is
preempting, not that its own request was. Its JSON::

    {"window_s": 60.0, "preemption_rate": 0.12, "preemptions": 12, "requests": 100,
     "free_block_ratio": 0.03, "recommendation": "backoff"}

``preemption_rate`` is preemptions per request ended in the window, so it can exceed 1.
The I/O itself lives in :mod:`kvscope.client.sdk`; this module is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

Recommendation = Literal["ok", "backoff", "shed"]
STALE_AFTER_POLLS = 3
"""A reading older than this many poll intervals is ignored."""


@dataclass(frozen=True)
class PreemptRateReading:
    """One answer of the sidecar, stamped with the client's clock."""

    window_s: float
    preemption_rate: float
    preemptions: int
    requests: int
    free_block_ratio: float | None
    recommendation: Recommendation
    fetched_at: float

    @property
    def per_ended_request(self) -> float:
        """Preemptions per request ended in the window, as they are: infinite when
        preemptions came and no request ended (the sidecar's JSON, having no infinity,
        says 1.0 then)."""
        if self.requests == 0 and self.preemptions > 0:
            return math.inf
        return self.preemption_rate

    @property
    def evidence(self) -> int:
        """How many events the rate rests on (preemptions count when few requests ended)."""
        return max(self.requests, self.preemptions)


def parse_reading(payload: Any, fetched_at: float) -> PreemptRateReading:
    """Read the sidecar's JSON; ValueError names every missing or malformed field."""
    if not isinstance(payload, dict):
        raise ValueError("preempt-rate answer is not a JSON object")
    errors: list[str] = []

    def number(name: str, kind: type, optional: bool = False) -> Any:
        value = payload.get(name)
        if value is None and optional:
            return None
        if (isinstance(value, (int, float) if kind is float else int)
                and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
            return value
        errors.append(f"{name}={value!r}")
        return None

    fields = (number("window_s", float), number("preemption_rate", float),
              number("preemptions", int), number("requests", int),
              number("free_block_ratio", float, optional=True))
    rec = payload.get("recommendation")
    if rec not in get_args(Recommendation):
        errors.append(f"recommendation={rec!r}")
    if errors:
        raise ValueError("preempt-rate answer has bad fields: " + ", ".join(errors))
    window_s, rate, preemptions, requests, free = fields
    return PreemptRateReading(float(window_s), float(rate), preemptions, requests,
                              None if free is None else float(free),
                              cast(Recommendation, rec), fetched_at)


class PollSchedule:
    """When to poll, and the latest reading still fresh enough to use."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._last_attempt: float | None = None
        self.latest: PreemptRateReading | None = None
        self.failures = 0

    def due(self, now: float) -> bool:
        """True at most once per ``poll_s``, failed polls included."""
        if self._last_attempt is not None and now - self._last_attempt < self.poll_s:
            return False
        self._last_attempt = now
        return True

    def update(self, reading: PreemptRateReading | None) -> None:
        """Keep a new reading; None records a failed poll (the old reading stays)."""
        if reading is None:
            self.failures += 1
        else:
            self.latest = reading

    def current(self, now: float) -> PreemptRateReading | None:
        reading = self.latest
        if reading is None or now - reading.fetched_at > STALE_AFTER_POLLS * self.poll_s:
            return None
        return reading
