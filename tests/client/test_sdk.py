"""The SDK's behaviour, for the sync and the async client alike (``make`` is parametrised).

Time is a fake clock; every sleep is recorded and moves that clock, so the delays the SDK
chose are asserted exactly (jitter off unless a test says otherwise).
"""

from __future__ import annotations

import threading

import httpx
import pytest

from kvscope.client import APIStatusError, ClientConfig, KVScopeClient, __all__
from kvscope.errors import ConfigError
from tests.client.conftest import MakeHarness
from tests.client.fakes import Answer, FakeOpenAIServer


def test_public_names() -> None:
    assert {"KVScopeClient", "AsyncKVScopeClient", "ClientConfig", "CircuitOpenError"} <= set(
        __all__)


def test_sends_client_id_user_agent_and_key_to_openai_paths(make: MakeHarness) -> None:
    h = make(client_kw={"api_key": "sk-secret", "base_url": "http://vllm:8000/v1/"})
    assert h.complete(max_tokens=4)["object"] == "text_completion"
    assert h.chat()["object"] == "chat.completion"
    comp, chat = h.server.requests
    assert str(comp.url) == "http://vllm:8000/v1/completions"
    assert str(chat.url) == "http://vllm:8000/v1/chat/completions"
    assert comp.headers["x-client-id"] == "team-a"
    assert comp.headers["user-agent"] == "kvscope-client/0.1.0"
    assert comp.headers["authorization"] == "Bearer sk-secret"
    assert h.server.bodies()[0] == {"model": "tiny", "prompt": "hello", "max_tokens": 4}
    assert h.sleep.calls == []


def test_client_id_header_is_configurable(make: MakeHarness) -> None:
    h = make(client_kw={"client_id_header": "X-Tenant"})
    h.complete()
    assert h.server.requests[0].headers["x-tenant"] == "team-a"
    assert "authorization" not in h.server.requests[0].headers


def test_429_retry_after_seconds_is_honoured(make: MakeHarness) -> None:
    h = make()
    h.server.push(Answer(429, {"Retry-After": "7"}))
    assert h.complete()["choices"][0]["text"] == "hi"
    assert h.sleep.calls == [7.0]
    assert len(h.server.requests) == 2
    st = h.client.state()
    assert st.retries_total == 1 and st.window.counts["overloaded"] == 1


def test_503_retry_after_http_date_is_read_against_the_answers_date(make: MakeHarness) -> None:
    h = make()
    h.server.push(Answer(503, {"Date": "Wed, 21 Oct 2015 07:28:00 GMT",
                               "Retry-After": "Wed, 21 Oct 2015 07:28:12 GMT"}))
    h.complete()
    assert h.sleep.calls == [12.0]


def test_retry_after_beyond_the_cap_is_raised_at_once(make: MakeHarness) -> None:
    h = make(max_retry_after_s=30.0)
    h.server.push(Answer(429, {"Retry-After": "120"}))
    with pytest.raises(APIStatusError) as exc:
        h.complete()
    assert (exc.value.status_code, exc.value.retry_after_s, exc.value.attempts) == (429, 120, 1)
    assert h.sleep.calls == [] and len(h.server.requests) == 1


def test_retries_back_off_exponentially_then_raise(make: MakeHarness) -> None:
    h = make(max_retries=3, retry_base_delay_s=0.5)
    h.server.push(503, 503, 503, 503)
    with pytest.raises(APIStatusError) as exc:
        h.complete()
    assert exc.value.attempts == 4
    assert h.sleep.calls == [0.5, 1.0, 2.0]


def test_connect_errors_are_retried_and_reraised_as_httpx_errors(make: MakeHarness) -> None:
    h = make(max_retries=2)
    h.server.push(*[Answer(error=httpx.ConnectError)] * 3)
    with pytest.raises(httpx.ConnectError):
        h.complete()
    assert len(h.server.requests) == 3 and h.sleep.calls == [0.5, 1.0]
    assert h.client.state().window.counts["error"] == 3


def test_read_timeouts_count_as_overload_and_may_be_left_unretried(make: MakeHarness) -> None:
    h = make(retry_read_timeouts=False)
    h.server.push(Answer(error=httpx.ReadTimeout))
    with pytest.raises(httpx.ReadTimeout):
        h.complete()
    assert len(h.server.requests) == 1
    assert h.client.state().window.counts["overloaded"] == 1


def test_other_errors_are_not_retried(make: MakeHarness) -> None:
    h = make()
    h.server.push(400)
    with pytest.raises(APIStatusError) as exc:
        h.complete()
    assert exc.value.status_code == 400 and "scripted" in exc.value.body
    assert len(h.server.requests) == 1 and h.sleep.calls == []


def fill(h: object, ok: int, bad: int) -> None:
    """Send ``ok`` good calls then ``bad`` 429s (each raised: retries are off)."""
    h.server.push(*([200] * ok + [429] * bad))  # type: ignore[attr-defined]
    for _ in range(ok + bad):
        try:
            h.complete()  # type: ignore[attr-defined]
        except APIStatusError:
            pass


def test_no_delay_at_5_percent_then_delays_start_above_it(make: MakeHarness) -> None:
    h = make(max_retries=0)
    fill(h, ok=95, bad=5)
    assert h.client.state().pressure == 0.05 and h.sleep.calls == []
    h.complete()  # 5 / 100 is not above 5 %: sent at once
    assert h.sleep.calls == []
    fill(h, ok=0, bad=1)  # 6 / 102
    h.complete()
    assert h.sleep.calls == [pytest.approx(0.1 * (6 / 102) / 0.05)]


def test_delay_grows_with_the_rate_and_is_capped(make: MakeHarness) -> None:
    h = make(max_retries=0, backoff_max_delay_s=1.5)
    fill(h, ok=8, bad=2)  # 20 %: four times the threshold
    h.complete()
    fill(h, ok=0, bad=39)  # 42 / 51: far above, capped
    h.complete()
    pressure = [d for d in h.sleep.calls if d]
    assert pressure[0] == pytest.approx(0.4)
    assert pressure[-1] == 1.5


def test_too_few_outcomes_are_not_pressure(make: MakeHarness) -> None:
    h = make(max_retries=0, min_samples=10)
    fill(h, ok=0, bad=3)
    h.complete()
    assert h.sleep.calls == [] and h.client.state().pressure is None


def test_window_forgets_outcomes_older_than_window_s(make: MakeHarness) -> None:
    h = make(max_retries=0, window_s=60.0)
    fill(h, ok=5, bad=5)
    h.clock.advance(60.0)
    st = h.client.state()
    assert st.window.requests == 0 and st.pressure is None


def test_jitter_stays_within_its_band(make: MakeHarness) -> None:
    h = make(max_retries=0, jitter_ratio=0.5)
    fill(h, ok=8, bad=2)
    for _ in range(20):
        h.complete()
    full = [0.1 * (2 / (10 + i)) / 0.05 for i in range(20)]  # the rate falls as oks arrive
    assert len(h.sleep.calls) == 20
    assert all(d / 2 - 1e-9 <= got <= d + 1e-9 for d, got in zip(full, h.sleep.calls, strict=True))
    assert any(got < d * 0.9 for d, got in zip(full, h.sleep.calls, strict=True))


def test_preempted_header_counts_as_preemption(make: MakeHarness) -> None:
    h = make()
    h.server.push(Answer(200, {"x-kvscope-preempted": "2"}),
                  Answer(200, {"x-kvscope-preempted": "0"}))
    h.complete()
    h.complete()
    counts = h.client.state().window.counts
    assert (counts["preempted"], counts["ok"]) == (1, 1)


def test_streaming_is_refused(make: MakeHarness) -> None:
    h = make()
    with pytest.raises(ValueError, match="stream"):
        h.complete(stream=True)
    assert h.server.requests == []


def test_sync_client_is_thread_safe() -> None:
    server = FakeOpenAIServer()
    client = KVScopeClient(client_id="t", http=httpx.Client(transport=server.transport()))

    def work() -> None:
        for _ in range(50):
            client.completions(model="m", prompt="p")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert client.state().window.counts["ok"] == 400 and len(server.requests) == 400
    client._http.close()


def test_a_call_deadline_bounds_its_retries_and_each_attempt(make: MakeHarness) -> None:
    """Retries, their delays and each attempt's timeout added up with no bound: four
    retries of a server that times out at 600 s were 40 minutes of one call. With
    ``call_deadline_s`` no retry starts whose delay ends past it, and each attempt's
    timeouts are what is left of it (never longer than the client's own)."""
    h = make(call_deadline_s=3.0, max_retries=5, retry_base_delay_s=0.5)
    h.server.push(503, 503, 503, 503, 503, 503)
    with pytest.raises(APIStatusError) as exc:
        h.complete()
    assert exc.value.attempts == 3 and h.sleep.calls == [0.5, 1.0]  # then 2.0: past 3 s
    timeouts = [r.extensions["timeout"] for r in h.server.requests]
    assert timeouts == [dict.fromkeys(("connect", "read", "write", "pool"), left)
                        for left in (3.0, 2.5, 1.5)]
    short = make(call_deadline_s=30.0, client_kw={"http_timeout": 2.0})
    short.complete()
    assert short.server.requests[0].extensions["timeout"]["read"] == 2.0


def test_without_a_call_deadline_attempts_keep_the_client_s_timeout(make: MakeHarness) -> None:
    h = make()
    h.complete()
    assert h.server.requests[0].extensions["timeout"]["read"] == 600.0


def test_a_call_deadline_leaves_room_for_the_longest_pressure_delay() -> None:
    with pytest.raises(ConfigError, match="call_deadline_s must exceed backoff_max_delay_s"):
        ClientConfig(call_deadline_s=2.0, backoff_max_delay_s=2.0)
