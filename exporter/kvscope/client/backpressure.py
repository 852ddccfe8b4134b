"""Backpressure policy: what an answer means, how long to wait before sending or retrying.

Pure functions of their arguments (randomness comes from the ``rng`` passed in).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime

import httpx

from kvscope.client.config import ClientConfig
from kvscope.client.window import Outcome

OVERLOAD_STATUSES = frozenset({429, 503, 504})
"""Answers that mean "not now": counted as overload and retried."""
PREEMPTED_HEADER = "x-kvscope-preempted"
"""Times this request was preempted, if a kvscope middleware reports it (none does yet)."""


@dataclass(frozen=True)
class Verdict:
    """What one attempt's result means for the window, the breaker and the retry loop."""

    outcome: Outcome
    retriable: bool
    retry_after_s: float | None = None
    """The server's Retry-After, in seconds from now, when it sent a readable one."""


def jitter(delay_s: float, cfg: ClientConfig, rng: random.Random) -> float:
    """A delay drawn from [delay * (1 - jitter_ratio), delay]."""
    return delay_s * (1.0 - cfg.jitter_ratio * rng.random())


def pressure_delay(bad_rate: float | None, cfg: ClientConfig, rng: random.Random) -> float:
    """Delay before sending, 0 at or below ``backoff_threshold``.

    Above it the delay is ``backoff_base_delay_s * rate / threshold``, so it starts near
    the base delay and grows with the rate, capped at ``backoff_max_delay_s``, jittered so
    that many clients seeing the same rate do not resend in lockstep.
    """
    if bad_rate is None or bad_rate <= cfg.backoff_threshold:
        return 0.0
    scale = bad_rate / cfg.backoff_threshold if cfg.backoff_threshold > 0 else math.inf
    return jitter(min(cfg.backoff_max_delay_s, cfg.backoff_base_delay_s * scale), cfg, rng)


def retry_delay(retry: int, cfg: ClientConfig, rng: random.Random) -> float:
    """Exponential delay before retry number ``retry`` (0-based), capped and jittered."""
    raw = cfg.retry_base_delay_s * 2.0 ** min(retry, 60)
    return jitter(min(cfg.retry_max_delay_s, raw), cfg, rng)


def parse_retry_after(value: str | None, date_header: str | None,
                      now_epoch: float) -> float | None:
    """Seconds to wait from a Retry-After value: delay-seconds or an HTTP date.

    A date is measured against the answer's own ``Date`` header when present (both come
    from the server's clock, so clock skew cancels), else against ``now_epoch``. Fractional
    seconds are accepted; unreadable or negative values give None; past dates give 0.
    """
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    when = _http_date(value)
    if when is None:
        return None
    base = _http_date(date_header) if date_header else None
    return max(0.0, when - (base if base is not None else now_epoch))


def _http_date(value: str) -> float | None:
    """An HTTP date in epoch seconds: GMT (RFC 9110), also where the form names no zone
    (asctime's, or ``-0000``), which ``parsedate_to_datetime`` leaves naive."""
    try:
        when = parsedate_to_datetime(value)
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return when.timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def classify_response(status: int, headers: Mapping[str, str], now_epoch: float,
                      cfg: ClientConfig | None = None) -> Verdict:
    """The meaning of an HTTP answer. A 504 is a gateway that stopped waiting while the
    server may still be generating: retried only where ``cfg.retry_read_timeouts``
    accepts a duplicate submission, as a read timeout is."""
    if 200 <= status < 300:
        return Verdict("preempted" if _preempted(headers) else "ok", retriable=False)
    if status in OVERLOAD_STATUSES:
        after = parse_retry_after(headers.get("retry-after"), headers.get("date"), now_epoch)
        retriable = status != 504 or cfg is None or cfg.retry_read_timeouts
        return Verdict("overloaded", retriable=retriable, retry_after_s=after)
    return Verdict("error", retriable=False)


def _preempted(headers: Mapping[str, str]) -> bool:
    raw = headers.get(PREEMPTED_HEADER)
    try:
        return raw is not None and int(raw.strip()) > 0
    except ValueError:
        return False


def classify_exception(exc: httpx.TransportError, cfg: ClientConfig) -> Verdict:
    """The meaning of a transport failure (no answer at all)."""
    if isinstance(exc, httpx.ConnectTimeout):
        return Verdict("overloaded", retriable=True)  # never reached the server
    if isinstance(exc, httpx.ReadTimeout | httpx.WriteTimeout):
        return Verdict("overloaded", retriable=cfg.retry_read_timeouts)
    if isinstance(exc, httpx.PoolTimeout | httpx.ConnectError):
        return Verdict("error", retriable=True)  # our own pool, or nothing listening
    return Verdict("error", retriable=False)  # the request may have been processed
