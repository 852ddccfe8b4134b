"""``kvscope explain`` against a real vLLM CPU server under a load that preempts: the
sidecar's ``/api/requests/{X-Request-Id}`` (from its embedded store) is checked against
what vLLM itself counted for each request and against the latency each client measured.
The callers' IDs hold a comma and spaces, as vLLM takes them, and one is longer than 128
characters (the store keeps its digest): each must come back as the caller's one engine
request, with each preemption's requester as vLLM named it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.engine.conftest import EngineStack
from tests.engine.figures import wait_until_quiet

pytestmark = pytest.mark.engine
N, PROMPT_WORDS, MAX_TOKENS = 24, 160, 600
"""24 x ~760 tokens (24 blocks each) on a 48 x 32-token pool: two requests running at once
fill it. With 200 output tokens (12 blocks) the load needed four at once, and with the
other CI worker busy on the second core the API server let them in one by one: 0 of 24
preempted in one CI run. It did again with these (the client measured up to 23 s more than
the engine held a request: they reached the engine one after another), so a load that
preempted nothing is followed by another, up to ``ROUNDS`` in all."""
ROUNDS = 3


def request_id(i: int, round_: int) -> str:
    """The caller's X-Request-Id: a comma and spaces; request 0's over 128 characters."""
    rid = f"explain, {i} x" if round_ == 0 else f"explain, {round_}-{i} x"
    return rid + " " + "z" * 200 if i == 0 else rid


def send(url: str, i: int, round_: int) -> tuple[str, float]:
    rid = request_id(i, round_)
    body = {"model": "tiny", "prompt": " ".join(f"w{(i * 7 + k) % 900}" for k in
                                                range(PROMPT_WORDS)),
            "max_tokens": MAX_TOKENS, "ignore_eos": True}
    started = time.time()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300, trust_env=False,
                   headers={"X-Request-Id": rid, "X-Client-Id": "explainer"})
    r.raise_for_status()
    return rid, time.time() - started


def explained(stack: EngineStack, rid: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The answer once the request's trace and client row are in the store."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{stack.sidecar.url}/api/requests/{quote(rid, safe='')}", timeout=30,
                      trust_env=False)
        body = r.json() if r.status_code == 200 else {}
        ers = body.get("engine_requests") or []
        if ers and ers[0]["trace"] and body["api_requests"]:
            return body
        assert time.monotonic() < deadline, (rid[:40], r.status_code, r.text[:300])
        time.sleep(1.0)


def test_explain_matches_the_server_and_the_clients(engine_stack: EngineStack,
                                                    record_property: Any) -> None:
    preempted = gaps = rounds = 0
    while not preempted and rounds < ROUNDS:
        with ThreadPoolExecutor(N) as pool:
            measured = dict(pool.map(send, [engine_stack.vllm.url] * N, range(N),
                                     [rounds] * N))
        wait_until_quiet(engine_stack)
        rounds += 1
        p, g = check_explained(engine_stack, measured)
        preempted, gaps = preempted + p, max(gaps, g)
    record_property("preempted_requests", preempted)
    record_property("load_rounds", rounds)
    record_property("max_client_minus_engine_s", round(gaps, 4))
    print(f"explain engine figures: {preempted}/{N * rounds} preempted in {rounds} loads, "
          f"client - engine latency at most {gaps:.4f} s")
    assert preempted > 0


def check_explained(engine_stack: EngineStack, measured: dict[str, float]) -> tuple[int, float]:
    """Every request's explain answer against vLLM's counts and the client's latency; how
    many were preempted, and the largest client - engine latency."""
    preempted = 0
    gaps = 0.0
    for rid, client_s in measured.items():
        body = explained(engine_stack, rid)
        (er,) = body["engine_requests"]
        (api,) = body["api_requests"]
        assert api["engine_ids"] == [er["request_id"]]
        assert er["request_id"].startswith(f"cmpl-{rid}-0-")
        pre = er["preemptions"]
        events = [e for e in er["timeline"] if e["event"] == "preempted"]
        # vLLM's own per-request count (Request.num_preemptions, in the trace) and the events
        assert len(pre) == er["trace"]["preempt_count"] == len(events)
        assert [p["step"] for p in pre] == [e["step"] for e in events]
        lost = er["lost"]
        assert (lost["waiting"]["steps"] + lost["preempted"]["steps"] + lost["running"]["steps"]
                == lost["total"]["steps"])
        # the engine's part of the latency fits inside what the client measured (1 ms: the
        # store keeps milliseconds), and inside what the middleware measured
        assert lost["total"]["seconds"] <= client_s + 0.001
        assert lost["total"]["seconds"] <= body["api_requests"][0]["duration_s"] + 0.001
        gaps = max(gaps, client_s - lost["total"]["seconds"])
        outside = er["outside_engine_s"]  # the API server's share, which explain reports
        assert outside == pytest.approx(body["api_requests"][0]["duration_s"]
                                        - lost["total"]["seconds"], abs=1e-6)
        for p in pre:
            assert p["requester_is_victim"] or p["trigger"] is not None, p
        preempted += bool(pre)
    return preempted, gaps
