"""Pure parts: the window, the backpressure policy, Retry-After, the config."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from kvscope.client import ClientConfig, SlidingWindow
from kvscope.client.backpressure import (
    classify_exception,
    classify_response,
    parse_retry_after,
    pressure_delay,
    retry_delay,
)
from kvscope.errors import ConfigError
from tests.client.fakes import FakeClock

EXACT = ClientConfig(jitter_ratio=0.0)


def test_window_slides_and_counts_every_kind() -> None:
    clock = FakeClock(0.0)
    w = SlidingWindow(60.0, clock)
    assert w.rates().bad_rate is None
    for outcome in ("ok", "ok", "preempted", "overloaded", "error"):
        w.record(outcome)  # type: ignore[arg-type]
        clock.advance(10.0)
    r = w.rates()
    assert (r.requests, r.preempted_rate, r.overload_rate, r.bad_rate) == (5, 0.2, 0.2, 0.4)
    clock.now = 60.0  # the first outcome (t=0) leaves the window
    assert w.rates().requests == 4 and w.rates().counts["ok"] == 1
    clock.now = 200.0
    assert w.rates().requests == 0
    with pytest.raises(ValueError):
        w.record("timeout")  # type: ignore[arg-type]


@pytest.mark.parametrize(("rate", "delay"), [
    (None, 0.0), (0.0, 0.0), (0.05, 0.0), (0.0501, 0.1002), (0.10, 0.2), (0.5, 1.0), (3.0, 2.0),
])
def test_pressure_delay_starts_above_the_threshold_and_is_capped(
        rate: float | None, delay: float) -> None:
    assert pressure_delay(rate, EXACT, random.Random(0)) == pytest.approx(delay)


def test_retry_delay_doubles_and_is_capped() -> None:
    delays = [retry_delay(i, EXACT, random.Random(0)) for i in range(7)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert retry_delay(10_000, EXACT, random.Random(0)) == 8.0


@pytest.mark.parametrize(("value", "date", "now", "expected"), [
    ("3", None, 0.0, 3.0),
    (" 0.5 ", None, 0.0, 0.5),
    ("0", None, 0.0, 0.0),
    ("-1", None, 0.0, None),
    ("nan", None, 0.0, None),
    ("soon", None, 0.0, None),
    ("", None, 0.0, None),
    (None, None, 0.0, None),
    ("Wed, 21 Oct 2015 07:28:30 GMT", "Wed, 21 Oct 2015 07:28:00 GMT", 0.0, 30.0),
    ("Wed, 21 Oct 2015 07:28:30 GMT", None, 1445412500.0, 10.0),  # no Date: our clock
    ("Wed, 21 Oct 2015 07:28:30 GMT", "garbage", 1445412500.0, 10.0),
    ("Wed, 21 Oct 2015 07:27:00 GMT", "Wed, 21 Oct 2015 07:28:00 GMT", 0.0, 0.0),
])
def test_retry_after_seconds_or_http_date(value: str | None, date: str | None, now: float,
                                          expected: float | None) -> None:
    assert parse_retry_after(value, date, now) == expected


@pytest.mark.parametrize(("status", "outcome", "retriable"), [
    (200, "ok", False), (201, "ok", False), (400, "error", False), (404, "error", False),
    (429, "overloaded", True), (500, "error", False), (502, "error", False),
    (503, "overloaded", True), (504, "overloaded", True),
])
def test_statuses(status: int, outcome: str, retriable: bool) -> None:
    v = classify_response(status, httpx.Headers({"x-kvscope-preempted": "bogus"}), 0.0)
    assert (v.outcome, v.retriable) == (outcome, retriable)


def test_an_http_date_without_a_zone_is_gmt_whatever_the_local_zone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP dates are GMT (RFC 9110), asctime's form included, which names no zone:
    read as local time it was off by the machine's offset (9 h in Tokyo)."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        for form in ("Wed Oct 21 07:28:30 2015", "Wed, 21 Oct 2015 07:28:30 -0000"):
            assert parse_retry_after(form, None, 1445412500.0) == 10.0, form
    finally:
        monkeypatch.undo()
        time.tzset()


def test_a_gateway_timeout_is_retried_only_where_duplicates_are_accepted() -> None:
    """A 504 is a gateway that stopped waiting: vLLM may still be generating the first
    attempt, as after a read timeout, so retry_read_timeouts=False (no duplicate
    submissions) covers it too."""
    safe = ClientConfig(retry_read_timeouts=False)
    v = classify_response(504, httpx.Headers(), 0.0, safe)
    assert (v.outcome, v.retriable) == ("overloaded", False)
    assert classify_response(503, httpx.Headers(), 0.0, safe).retriable  # refused: unsent
    assert classify_response(504, httpx.Headers(), 0.0, ClientConfig()).retriable


def test_preempted_header() -> None:
    assert classify_response(200, httpx.Headers({"X-KVScope-Preempted": "1"}), 0).outcome == \
        "preempted"
    assert classify_response(200, httpx.Headers({"x-kvscope-preempted": "0"}), 0).outcome == "ok"


@pytest.mark.parametrize(("exc", "outcome", "retriable"), [
    (httpx.ConnectTimeout, "overloaded", True),
    (httpx.ReadTimeout, "overloaded", True),
    (httpx.WriteTimeout, "overloaded", True),
    (httpx.PoolTimeout, "error", True),
    (httpx.ConnectError, "error", True),
    (httpx.RemoteProtocolError, "error", False),
    (httpx.ReadError, "error", False),
])
def test_transport_errors(exc: type[httpx.TransportError], outcome: str,
                          retriable: bool) -> None:
    v = classify_exception(exc("x"), ClientConfig())
    assert (v.outcome, v.retriable) == (outcome, retriable)
    assert classify_exception(httpx.ReadTimeout("x"),
                              ClientConfig(retry_read_timeouts=False)).retriable is False


def test_config_reports_every_error_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        ClientConfig(window_s=0, backoff_threshold=1.5, max_retries=-1, half_open_probes=0,
                     open_threshold=0.01, backoff_max_delay_s=0.01)
    assert len(exc.value.errors) == 6, exc.value.errors
    with pytest.raises(ConfigError) as exc:
        ClientConfig(window_s="60", min_samples=2.5, retry_read_timeouts="yes")  # type: ignore[arg-type]
    assert len(exc.value.errors) == 3
    with pytest.raises(ConfigError):
        ClientConfig(window_s=float("inf"))


def test_config_is_frozen() -> None:
    cfg = ClientConfig()
    with pytest.raises(AttributeError):
        cfg.window_s = 1.0  # type: ignore[misc]
