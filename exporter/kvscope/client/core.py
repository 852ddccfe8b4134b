"""The SDK's logic without I/O: one call is a generator of actions a driver carries out.

:meth:`ClientCore.call` yields :class:`Poll` (read the sidecar), :class:`Sleep` and
:class:`Send`; the sync and async clients in :mod:`kvscope.client.sdk` perform them with
httpx and send back the result. So both clients share every decision, and the decisions
are testable with a fake clock.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import httpx

from kvscope.client import backpressure as bp
from kvscope.client.breaker import BreakerSnapshot, CircuitBreaker, Permit, Transition
from kvscope.client.breaker import WindowVerdict as BreakerWindow
from kvscope.client.config import ClientConfig
from kvscope.client.errors import APIStatusError, CircuitOpenError
from kvscope.client.preempt_rate import PollSchedule, PreemptRateReading, parse_reading
from kvscope.client.window import SlidingWindow, WindowRates

log = logging.getLogger("kvscope.client")


@dataclass(frozen=True)
class Poll:
    """Read the sidecar; reply with its decoded JSON, or None when that failed."""


@dataclass(frozen=True)
class Sleep:
    seconds: float
    reason: str


@dataclass(frozen=True)
class Send:
    """Send the request; reply with the httpx.Response or the httpx.TransportError."""

    time_left: float | None = None
    """What is left of the call's deadline: the most each of the attempt's timeouts may
    be (None: no deadline)."""


Action = Poll | Sleep | Send


@dataclass(frozen=True)
class ClientState:
    """What the SDK currently believes, for logs, metrics or a debugging session."""

    window: WindowRates
    """The client's own outcomes over the sliding window."""
    server: PreemptRateReading | None
    """The latest fresh sidecar reading (None without a preempt_rate_url or when stale)."""
    pressure: float | None
    """The bad rate the backpressure acts on: the larger of the two, where evidence is
    sufficient (``min_samples``); None when neither has enough."""
    breaker: BreakerSnapshot
    retries_total: int
    sidecar_poll_failures: int


class ClientCore:
    """Window, breaker, sidecar schedule and policy for one client; thread-safe."""

    def __init__(self, config: ClientConfig, clock: Callable[[], float],
                 rng: random.Random | None = None, polls_sidecar: bool = False,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._polls = PollSchedule(config.preempt_rate_poll_s) if polls_sidecar else None
        self.window = SlidingWindow(config.window_s, clock)
        self.breaker = CircuitBreaker(config, clock, observer=_log_breaker_event)
        self.retries_total = 0

    def call(self) -> Generator[Action, Any, httpx.Response]:
        """Plan one API call; returns the 2xx response, raises what the caller should see.

        A due poll of the sidecar comes first; then the breaker is asked, so an open
        circuit raises before any backpressure delay or request. Once a request was sent,
        a retry the breaker refuses (open when the attempt is recorded: no retry delay is
        spent on it; half-open with its probes out: the refusal chained as the cause)
        raises that attempt's own error, its status or the transport error:
        CircuitOpenError says nothing was sent, and a caller who took it at its word would
        send again a request that may still be running.
        """
        retry = 0
        last: Exception | None = None
        deadline = self.config.call_deadline_s
        ends = None if deadline is None else self._clock() + deadline
        while True:
            yield from self._poll()
            with self._lock:
                try:
                    permit = self.breaker.acquire()
                except CircuitOpenError as refused:
                    if last is None:
                        raise
                    raise last from refused
                delay = 0.0 if retry else bp.pressure_delay(self._pressure(), self.config,
                                                            self._rng)
            reply = yield from self._send(permit, delay, ends)
            if isinstance(reply, httpx.Response):
                verdict = bp.classify_response(reply.status_code, reply.headers,
                                               self._wall_clock(), self.config)
            else:
                verdict = bp.classify_exception(reply, self.config)
            with self._lock:
                self.window.record(verdict.outcome)
                self.breaker.record(permit, verdict.outcome, self._server_rate())
            if isinstance(reply, httpx.Response) and reply.is_success:
                return reply
            last = (APIStatusError(reply.status_code, reply.text, retry + 1,
                                   verdict.retry_after_s)
                    if isinstance(reply, httpx.Response) else reply)
            wait = self._retry_wait(verdict, retry)
            if wait is not None and ends is not None and self._clock() + wait >= ends:
                wait = None  # the retry would start past the call's deadline
            with self._lock:
                open_now = self.breaker.snapshot().state == "open"
            if wait is None or open_now:  # no retry, or one the breaker would refuse
                raise last
            log.debug("kvscope client: attempt %d was %s; retrying in %.2f s",
                      retry + 1, verdict.outcome, wait)
            yield Sleep(wait, "retry")
            retry += 1
            with self._lock:
                self.retries_total += 1

    def _send(self, permit: Permit, delay: float,
              ends: float | None) -> Generator[Action, Any, Any]:
        settled = False
        try:
            if delay > 0:
                yield Sleep(delay, "pressure")
            reply = yield Send(None if ends is None else max(ends - self._clock(), 0.0))
            settled = True
            return reply
        finally:
            if not settled:  # cancelled or an unexpected error: free a probe slot
                with self._lock:
                    self.breaker.release(permit)

    def _poll(self) -> Generator[Action, Any, None]:
        if self._polls is None:
            return
        with self._lock:
            due = self._polls.due(self._clock())
        if not due:
            return
        payload = yield Poll()
        reading = None
        if payload is not None:
            try:
                reading = parse_reading(payload, self._clock())
            except ValueError as exc:
                log.warning("kvscope client: ignoring the sidecar's answer: %s", exc)
        with self._lock:
            self._polls.update(reading)
            first_failure = reading is None and self._polls.failures == 1
        if first_failure:
            log.warning("kvscope client: could not read the sidecar's /health/preempt-rate; "
                        "acting on this client's own outcomes until it answers")

    def _retry_wait(self, verdict: bp.Verdict, retry: int) -> float | None:
        cfg = self.config
        if not verdict.retriable or retry >= cfg.max_retries:
            return None
        if verdict.retry_after_s is not None:
            if verdict.retry_after_s > cfg.max_retry_after_s:
                return None  # longer than we will wait: the caller decides
            return verdict.retry_after_s
        with self._lock:
            return bp.retry_delay(retry, cfg, self._rng)

    def _server_rate(self) -> float | None:
        reading = self._fresh_reading()
        if reading is None or reading.evidence < self.config.min_samples:
            return None
        return reading.per_ended_request

    def _fresh_reading(self) -> PreemptRateReading | None:
        return None if self._polls is None else self._polls.current(self._clock())

    def _pressure(self) -> float | None:
        rates = self.window.rates()
        own = rates.bad_rate if rates.requests >= self.config.min_samples else None
        server = self._server_rate()
        candidates = [r for r in (own, server) if r is not None]
        return max(candidates) if candidates else None

    def state(self) -> ClientState:
        with self._lock:
            return ClientState(
                window=self.window.rates(), server=self._fresh_reading(),
                pressure=self._pressure(), breaker=self.breaker.snapshot(),
                retries_total=self.retries_total,
                sidecar_poll_failures=self._polls.failures if self._polls else 0,
            )


def _log_breaker_event(event: BreakerWindow | Transition) -> None:
    if isinstance(event, Transition):
        level = logging.WARNING if event.new == "open" else logging.INFO
        log.log(level, "kvscope client: circuit %s -> %s: %s", event.old, event.new,
                event.reason)
