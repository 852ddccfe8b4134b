"""The sidecar's /health/preempt-rate as the SDK reads it, sync and async alike."""

from __future__ import annotations

import logging
import math

import pytest

from kvscope.client import APIStatusError, CircuitOpenError
from kvscope.client.preempt_rate import parse_reading
from kvscope.sidecar.http.pressure import preempt_rate as sidecar_preempt_rate
from tests.client.conftest import Harness, MakeHarness
from tests.client.fakes import preempt_rate

URL = "http://127.0.0.1:9477/health/preempt-rate"


def test_the_real_sidecar_answer_parses() -> None:
    reading = parse_reading(sidecar_preempt_rate([], 60.0), fetched_at=5.0)
    assert (reading.requests, reading.preemption_rate, reading.recommendation) == (0, 0.0, "ok")


def test_server_rate_drives_the_delay_and_the_token_goes_only_to_the_sidecar(
        make: MakeHarness) -> None:
    h = make(client_kw={"preempt_rate_url": URL, "api_key": "sk-secret",
                        "sidecar_token": "t0k"})
    h.server.preempt_rate = preempt_rate(0.2)
    h.complete()
    assert h.sleep.calls == [pytest.approx(0.4)]
    (poll,) = h.server.sidecar_requests
    assert poll.headers["authorization"] == "Bearer t0k"
    assert h.server.requests[0].headers["authorization"] == "Bearer sk-secret"
    st = h.client.state()
    assert st.server is not None and st.server.preemption_rate == 0.2 and st.pressure == 0.2


def test_polls_at_most_every_poll_interval(make: MakeHarness) -> None:
    h = make(preempt_rate_poll_s=5.0, client_kw={"preempt_rate_url": URL})
    h.server.preempt_rate = preempt_rate(0.0)
    for _ in range(10):
        h.complete()
        h.clock.advance(0.25)
    assert len(h.server.sidecar_requests) == 1
    h.clock.advance(2.5)
    h.complete()
    assert len(h.server.sidecar_requests) == 2


def test_a_reading_goes_stale_and_failures_are_counted_and_warned_once(
        make: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    h = make(preempt_rate_poll_s=5.0, client_kw={"preempt_rate_url": URL})
    h.server.preempt_rate = preempt_rate(0.2)
    h.complete()
    h.server.preempt_rate = None  # the sidecar goes away
    with caplog.at_level(logging.WARNING, logger="kvscope.client"):
        for _ in range(3):
            h.clock.advance(5.0)
            h.complete()
    st = h.client.state()
    assert st.sidecar_poll_failures == 3 and st.server is None and st.pressure is None
    assert caplog.text.count("could not read the sidecar") == 1
    assert h.sleep.calls[:3] == [pytest.approx(0.4)] * 3  # still fresh at 5 and 10 s
    assert len(h.sleep.calls) == 3  # stale at 15 s + the delays: no pressure


def test_a_rate_on_little_evidence_is_ignored(make: MakeHarness) -> None:
    h = make(min_samples=10, client_kw={"preempt_rate_url": URL})
    h.server.preempt_rate = preempt_rate(0.5, requests=4)
    h.complete()
    assert h.sleep.calls == [] and h.client.state().pressure is None


@pytest.mark.parametrize("answer", [{"preemption_rate": "high"}, 500, ["not", "an", "object"]])
def test_a_bad_sidecar_answer_is_ignored(make: MakeHarness, answer: object) -> None:
    h = make(client_kw={"preempt_rate_url": URL})
    h.server.preempt_rate = answer  # type: ignore[assignment]
    h.complete()
    assert h.client.state().server is None and h.client.state().sidecar_poll_failures == 1


def open_on_the_server_rate(h: Harness) -> None:
    """Three 60 s windows of one call each, made bad by the sidecar's answer alone; the
    fourth call finds the circuit open."""
    start = h.clock()
    for k in range(3):
        h.clock.now = start + 60.0 * k + 1.0
        h.complete()  # one call a window: the sidecar's rate makes the window bad
    h.clock.now = start + 181.0
    with pytest.raises(CircuitOpenError):
        h.complete()


def test_server_rate_alone_opens_the_circuit_and_keeps_probes_failing(
        make: MakeHarness) -> None:
    h = make(max_retries=0, client_kw={"preempt_rate_url": URL})
    h.server.preempt_rate = preempt_rate(0.2)
    open_on_the_server_rate(h)
    h.clock.advance(1.0)
    h.complete()  # the probe is answered 200, but the server still reports 20 %
    assert h.client.state().breaker.state == "open"
    h.clock.advance(6.0)
    h.server.preempt_rate = preempt_rate(0.01)
    h.complete()
    assert h.client.state().breaker.state == "closed"


def test_preemptions_with_no_request_ended_are_not_said_as_a_rate(
        make: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    """The sidecar's JSON has no infinity: preemptions in its window and no request ended
    read preemption_rate 1.0 (kvscope.sidecar.http.pressure). The client opened its
    circuit on it, rightly, but said "the server's 1.00 preemptions per ended request"."""
    h = make(max_retries=0, client_kw={"preempt_rate_url": URL})
    thrashing = sidecar_preempt_rate([], 60.0) | {"preemption_rate": 1.0, "preemptions": 25,
                                                  "requests": 0, "recommendation": "shed"}
    h.server.preempt_rate = thrashing
    with caplog.at_level(logging.WARNING, logger="kvscope.client"):
        open_on_the_server_rate(h)
    st = h.client.state()
    assert st.breaker.state == "open" and st.server is not None
    assert st.server.per_ended_request == math.inf and st.pressure == math.inf
    assert "the server's preemptions and no request ended" in caplog.text, caplog.text
    assert "1.00 preemptions per ended request" not in caplog.text


def test_never_logs_prompts_messages_bodies_or_the_api_key(
        make: MakeHarness, caplog: pytest.LogCaptureFixture) -> None:
    h = make(max_retries=1, client_kw={"preempt_rate_url": URL, "api_key": "sk-secret"})
    with caplog.at_level(logging.DEBUG):
        h.server.push(429, 429, 503)
        with pytest.raises(APIStatusError):
            h.complete(prompt="PROMPT-TEXT")
        h.chat(messages=[{"role": "user", "content": "MESSAGE-TEXT"}])
    assert caplog.records, "the scenario should have logged something"
    for secret in ("PROMPT-TEXT", "MESSAGE-TEXT", "sk-secret", "scripted"):
        assert secret not in caplog.text
    assert "sk-secret" not in repr(h.client) and "sk-secret" not in repr(h.client.state())
