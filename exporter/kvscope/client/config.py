"""One frozen configuration for the client SDK, validated once, every error at once."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvscope.errors import ConfigError


@dataclass(frozen=True)
class ClientConfig:
    """Thresholds and limits of the SDK's backpressure and circuit breaker.

    "Bad" below means an outcome the SDK counts as pressure: an overload answer or a
    connect, read or write timeout, or a preemption it was told about (see
    :mod:`kvscope.client.window`).
    """

    window_s: float = 60.0
    """Length of the sliding window of outcomes, and of each breaker evaluation window."""
    min_samples: int = 10
    """A window (own outcomes, or the sidecar's counts) with less evidence than this is
    read as "no pressure": one bad answer out of two is noise, not a 50 % rate."""

    backoff_threshold: float = 0.05
    """Above this bad rate the SDK delays each call before sending it."""
    backoff_base_delay_s: float = 0.1
    """Delay at the threshold; it grows in proportion to rate / threshold."""
    backoff_max_delay_s: float = 2.0
    """Cap on the pressure delay."""
    jitter_ratio: float = 0.5
    """Each delay d is drawn from [d * (1 - jitter_ratio), d]; 0 makes delays exact."""

    max_retries: int = 3
    """Retries of a retriable failure (429 / 503 / 504, timeouts, connect errors)."""
    retry_base_delay_s: float = 0.5
    """First retry delay without Retry-After; doubles per retry."""
    retry_max_delay_s: float = 8.0
    """Cap on the exponential retry delay."""
    max_retry_after_s: float = 30.0
    """Longest Retry-After the SDK sleeps; a longer one is raised to the caller at once."""
    retry_read_timeouts: bool = True
    """Retry read / write timeouts and 504s (a gateway that stopped waiting). The server
    may still be generating the first attempt, so a retry is a duplicate submission;
    connect timeouts, 429 and 503 (refused, not started) are always retried."""

    open_threshold: float = 0.10
    """An evaluation window whose bad rate is above this counts toward opening."""
    open_after_windows: int = 3
    """Consecutive bad evaluation windows that open the circuit."""
    open_duration_s: float = 1.0
    """First time the circuit stays open before it lets probes through."""
    open_backoff_factor: float = 2.0
    """Each failed probe multiplies the open duration by this."""
    max_open_duration_s: float = 30.0
    """Cap on the grown open duration."""
    half_open_probes: int = 1
    """Requests let through while half-open; all must succeed to close."""

    preempt_rate_poll_s: float = 5.0
    """Poll the sidecar's /health/preempt-rate at most this often; a reading older than
    three polls is ignored."""
    preempt_rate_timeout_s: float = 1.0
    """httpx's timeout of one sidecar poll: each of its phases (connect, send, each read)
    is bounded by this, not the poll as a whole; a poll is due at most every
    ``preempt_rate_poll_s``, before the call that finds it due."""
    request_timeout_s: float = 600.0
    """Timeout of the HTTP client the SDK creates (a client passed in keeps its own)."""
    call_deadline_s: float | None = None
    """Bound on one call, from its start: no retry starts whose delay would end past it,
    and each attempt's timeouts (connect, write, pool, and the read of an answer, which a
    completion sends whole) are at most what is left of it. None: each attempt has the
    HTTP client's timeout and retries are bounded only by ``max_retries``. Must exceed
    ``backoff_max_delay_s``, so the first attempt always has time left."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` listing every problem."""
        errors: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _OPTIONAL and value is None:
                continue
            kind = "bool" if f.type == "bool" else "int" if f.type == "int" else "float"
            if kind == "bool":
                ok = isinstance(value, bool)
            else:
                ok = isinstance(value, int if kind == "int" else (int, float))
                ok = ok and not isinstance(value, bool) and math.isfinite(value)
            if not ok:
                what = "a bool" if kind == "bool" else f"a finite {kind}"
                errors.append(f"{f.name} must be {what} (got {value!r})")
        if errors:  # the range checks below need numbers
            raise ConfigError(errors)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in _UNIT_INTERVAL and not 0 <= value <= 1:
                errors.append(f"{f.name} must lie in [0, 1] (got {value!r})")
            elif f.name in _AT_LEAST and value < _AT_LEAST[f.name]:
                errors.append(f"{f.name} must be at least {_AT_LEAST[f.name]} (got {value!r})")
            elif f.type.startswith("float") and f.name not in _UNIT_INTERVAL | _AT_LEAST.keys() \
                    and value <= 0:
                errors.append(f"{f.name} must be positive (got {value!r})")
        for low, high in (("backoff_base_delay_s", "backoff_max_delay_s"),
                          ("retry_base_delay_s", "retry_max_delay_s"),
                          ("open_duration_s", "max_open_duration_s"),
                          ("backoff_threshold", "open_threshold")):
            if getattr(self, high) < getattr(self, low):
                errors.append(f"{high} must be at least {low}")
        if self.call_deadline_s is not None and \
                self.call_deadline_s <= self.backoff_max_delay_s:
            errors.append("call_deadline_s must exceed backoff_max_delay_s (the longest "
                          "delay before a first attempt)")
        if errors:
            raise ConfigError(errors)


_OPTIONAL = frozenset({"call_deadline_s"})
"""Fields that may be None (no bound)."""
_UNIT_INTERVAL = frozenset({"backoff_threshold", "open_threshold", "jitter_ratio"})
_AT_LEAST: dict[str, float] = {
    "min_samples": 1, "max_retries": 0, "open_after_windows": 1, "half_open_probes": 1,
    "open_backoff_factor": 1.0, "max_retry_after_s": 0.0,
}
