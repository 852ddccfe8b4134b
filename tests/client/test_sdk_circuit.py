"""The circuit breaker as a caller meets it, sync and async alike.

Evaluation windows are 60 s of the fake clock, anchored when the client is built.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from kvscope.client import APIStatusError, AsyncKVScopeClient, CircuitOpenError, ClientConfig
from tests.client.conftest import Harness, MakeHarness
from tests.client.fakes import Answer, FakeClock, RecordedSleep
from tests.client.test_sdk import fill


def three_bad_windows(h: Harness) -> None:
    """20 % of 429s in each of three consecutive 60 s windows, then step into the fourth."""
    start = h.clock()
    for k in range(3):
        h.clock.now = start + 60.0 * k + 1.0
        fill(h, ok=8, bad=2)
    h.clock.now = start + 180.0 + 1.0


def test_opens_after_three_bad_windows_and_refuses_without_sending(make: MakeHarness) -> None:
    h = make(max_retries=0)
    three_bad_windows(h)
    sent, slept = len(h.server.requests), list(h.sleep.calls)
    with pytest.raises(CircuitOpenError) as exc:
        h.complete()
    err = exc.value
    assert err.retry_after_s == pytest.approx(1.0) and err.status_code == 429
    assert "not sent" in str(err) and "above 10% for 3 consecutive 60 s windows" in str(err)
    assert "retry after 1.0 s" in str(err)
    assert len(h.server.requests) == sent and h.sleep.calls == slept  # no send, no delay
    st = h.client.state()
    assert st.breaker.state == "open" and st.breaker.rejected_total == 1


def test_two_bad_windows_and_a_calm_one_do_not_open(make: MakeHarness) -> None:
    h = make(max_retries=0)
    start = h.clock()
    for k, bad in enumerate([2, 2, 0, 2, 2]):
        h.clock.now = start + 60.0 * k + 1.0
        fill(h, ok=10 - bad, bad=bad)
    h.clock.now = start + 301.0
    h.complete()
    assert h.client.state().breaker.state == "closed"


def test_exactly_10_percent_is_not_above_it(make: MakeHarness) -> None:
    h = make(max_retries=0)
    start = h.clock()
    for k in range(4):
        h.clock.now = start + 60.0 * k + 1.0
        fill(h, ok=9, bad=1)
    assert h.client.state().breaker.state == "closed"


def test_half_open_probe_success_closes(make: MakeHarness) -> None:
    h = make(max_retries=0)
    three_bad_windows(h)
    with pytest.raises(CircuitOpenError):
        h.complete()
    h.clock.advance(1.0)
    assert h.complete()["object"] == "text_completion"  # the probe
    st = h.client.state()
    assert st.breaker.state == "closed" and st.breaker.opens_total == 1


def test_half_open_probe_failure_reopens_for_longer_up_to_the_cap(make: MakeHarness) -> None:
    h = make(max_retries=0, open_duration_s=1.0, open_backoff_factor=2.0,
             max_open_duration_s=5.0)
    three_bad_windows(h)
    waits = []
    for _ in range(5):
        with pytest.raises(CircuitOpenError) as exc:
            h.complete()
        waits.append(exc.value.retry_after_s)
        h.clock.advance(exc.value.retry_after_s)
        h.server.push(503)
        with pytest.raises(APIStatusError):
            h.complete()  # the probe, answered 503
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert h.client.state().breaker.state == "open"


def test_a_failed_probe_with_retries_left_surfaces_as_its_own_answer(make: MakeHarness) -> None:
    """The probe was sent and answered 429, and the reopened circuit refuses the retry:
    the caller gets the probe's own answer (the refusal as its cause), at once. It got
    CircuitOpenError, which says the request was not sent, after a retry delay spent for
    nothing."""
    h = make(max_retries=3)
    three_bad_windows(h)
    with pytest.raises(CircuitOpenError) as first:
        h.complete()
    h.clock.advance(first.value.retry_after_s)
    h.server.push(429)
    sent, slept = len(h.server.requests), list(h.sleep.calls)
    with pytest.raises(APIStatusError) as exc:
        h.complete()
    assert len(h.server.requests) == sent + 1  # the probe only; no retry
    assert (exc.value.status_code, exc.value.attempts) == (429, 1)
    cause = exc.value.__cause__
    assert cause is None or isinstance(cause, CircuitOpenError)
    assert h.sleep.calls == slept  # no retry delay spent on a circuit that refuses it
    assert h.client.state().breaker.state == "open"


def test_a_probe_that_timed_out_is_not_reported_as_never_sent(make: MakeHarness) -> None:
    """A probe whose answer did not come in time may still be running in vLLM: the
    caller gets the timeout, not CircuitOpenError's "request not sent"."""
    h = make(max_retries=3, retry_read_timeouts=True)
    three_bad_windows(h)
    with pytest.raises(CircuitOpenError) as first:
        h.complete()
    h.clock.advance(first.value.retry_after_s)
    h.server.push(Answer(error=httpx.ReadTimeout))
    with pytest.raises(httpx.ReadTimeout):
        h.complete()


def test_a_cancelled_async_probe_frees_its_slot() -> None:
    """Cancelling the task that carries the half-open probe must not wedge the breaker."""

    async def main() -> None:
        clock = FakeClock()
        sleep = RecordedSleep(clock)
        answers: list[int] = [200] * 8 + [429] * 2
        entered, never = asyncio.Event(), asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            status = answers.pop(0) if answers else 200
            if status == 0:  # the probe to cancel: hang until cancelled
                entered.set()
                await never.wait()
            return httpx.Response(status, json={"object": "text_completion", "choices": []})

        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        client = AsyncKVScopeClient(client_id="c", http=http, clock=clock,
                                    sleep=sleep.async_sleep,
                                    config=ClientConfig(max_retries=0, jitter_ratio=0.0))
        start = clock()
        for k in range(3):
            clock.now = start + 60.0 * k + 1.0
            answers[:] = [200] * 8 + [429] * 2
            for _ in range(10):
                with contextlib.suppress(APIStatusError):
                    await client.completions(model="m", prompt="p")
        clock.now = start + 181.0
        with pytest.raises(CircuitOpenError):
            await client.completions(model="m", prompt="p")
        clock.advance(1.0)
        answers[:] = [0]
        probe = asyncio.create_task(client.completions(model="m", prompt="p"))
        await entered.wait()
        with pytest.raises(CircuitOpenError, match="waiting for the half-open probe"):
            await client.completions(model="m", prompt="p")
        probe.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await probe
        assert client.state().breaker.state == "half_open"
        await client.completions(model="m", prompt="p")  # a new probe, answered 200
        assert client.state().breaker.state == "closed"
        await http.aclose()

    asyncio.run(main())
