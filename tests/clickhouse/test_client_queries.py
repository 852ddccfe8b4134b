"""Layer 5 saved queries on chDB, on rows made by kvscope's own client join."""

from __future__ import annotations

import time
from typing import Any

from kvscope.rows import ClientRequest
from kvscope.state.clients import ClientJoin
from kvscope.state.hashkey import Keyer
from kvscope.store import arrow, query, schema
from kvscope_probe import wire
from tests.unit.test_clients import start, trace


def client_rows() -> list[ClientRequest]:
    """Three clients: team-a resubmits one prompt 3 times within seconds and is
    preempted; team-b gets 429s in a burst; team-c is quiet."""
    out: list[Any] = []
    join = ClientJoin(out.append, keyer=Keyer(b"query-test-secret"), duplicate_window_s=10)
    now = float(int(time.time()) // 60 * 60 - 300)  # a minute start: no bucket straddled
    n = 0

    def one(client: str, prompt: str, dt: float, status: int = 200, preempts: int = 0,
            agent: str = "sdk/1") -> None:
        nonlocal n
        rid = f"kvs{n:032x}"
        n += 1
        join.on_client(start(rid=rid, client=client, prompt=prompt, ts=now + dt, agent=agent))
        join.on_trace(trace(f"cmpl-{rid}-0-abcdef12", preempts=preempts, arrival=now + dt + 0.1))
        join.on_client(wire.ClientEnd(rid, now + dt + 0.5, status, 0.5))

    for i in range(3):
        one("team-a", "same-prompt", i * 2.0, preempts=1)
    one("team-a", "other", 30.0)
    for i in range(6):
        one("team-b", f"p{i}", 40.0 + i, status=429, agent="curl/8")
    for i in range(4):
        one("team-c", f"q{i}", 50.0 + i)
    return [r for r in out if isinstance(r, ClientRequest)]


def load(store: Any) -> None:
    schema.apply_schema(store, store.database, 30, None)
    rows = client_rows()
    store.raw_insert("client_requests", None, arrow.encode("client_requests", rows),
                     fmt="Arrow")


def run(store: Any, name: str, **params: str) -> list[dict[str, Any]]:
    cols, rows = query.run_saved(store, query.SavedQuery.load(name), params)
    return [dict(zip(cols, r, strict=True)) for r in rows]


def test_preemption_rate_by_client_and_user_agent(store: Any) -> None:
    load(store)
    by = {r["client"]: r for r in run(store, "preemption_rate_by_client")}
    assert by["team-a"]["requests"] == 4 and by["team-a"]["preempted_requests"] == 3
    assert by["team-a"]["preemption_rate"] == 0.75 and by["team-a"]["duplicates"] == 2
    assert by["team-b"]["preemption_rate"] == 0 and by["team-c"]["requests"] == 4
    agents = {r["agent"]: r for r in run(store, "preemption_rate_by_user_agent")}
    assert agents["curl/8"]["requests"] == 6 and agents["sdk/1"]["preemptions"] == 3


def test_duplicate_submissions_and_retry_storms(store: Any) -> None:
    load(store)
    (dup,) = run(store, "duplicate_submissions")
    assert (dup["client"], dup["submissions"], dup["preemptions"]) == ("team-a", 3, 3)
    assert run(store, "duplicate_submissions", window_s="1") == []  # 2 s apart: not within 1 s
    storms = run(store, "retry_storms")
    assert [s["client"] for s in storms] == ["team-b"]
    assert storms[0]["overload_answers"] == 6


def test_duplicates_are_submissions_close_together_by_one_client(store: Any) -> None:
    """Three mistakes of duplicate_submissions: it measured the gap between answers
    (client_requests.ts), not submissions, as the sidecar does; it took every caller
    without a client ID for one client, where the sidecar tells API keys apart; and it
    counted every copy of the prompt in the window, not the group of repeats."""
    schema.apply_schema(store, store.database, 30, None)
    now = float(int(time.time()) // 60 * 60 - 600)
    rows: list[ClientRequest] = []

    def sent(rid: str, at: float, took: float, client: str = "c", key: str = "",
             prompt: str = "p") -> None:
        rows.append(ClientRequest(
            ts=now + at + took, request_id=rid, engine_request_ids="", model="m",
            endpoint="completions", client_id=client, user_agent="ua", api_key_hash=key,
            prompt_hash=prompt, prompt_chars=1, max_tokens=8, http_status=200,
            duration_s=took, duplicate=False, duplicate_of="", preempt_count=0,
            preempt_reason="", engine_ids=[]))

    sent("slow", 0.0, 40.0)  # submitted 5 s apart, answered 34 s apart: duplicates
    sent("fast", 5.0, 1.0)
    sent("long-a", 100.0, 25.0, prompt="q")  # submitted 25 s apart, answered 1 s apart
    sent("long-b", 125.0, 1.0, prompt="q")
    sent("key1", 200.0, 0.5, client="", key="k1" * 8, prompt="r")  # two API keys
    sent("key2", 202.0, 0.5, client="", key="k2" * 8, prompt="r")
    for i in range(4):  # an hourly job, and once a quick repeat of it
        sent(f"hourly-{i}", 300.0 + i * 60.0, 0.5, prompt="h")
    sent("hourly-again", 302.0, 0.5, prompt="h")
    store.raw_insert("client_requests", None, arrow.encode("client_requests", rows),
                     fmt="Arrow")
    got = {(r["client"], r["prompt_hash"]): r for r in run(store, "duplicate_submissions")}
    assert set(got) == {("c", "p"), ("c", "h")}
    assert got[("c", "p")]["submissions"] == 2 and got[("c", "p")]["span_seconds"] == 5.0
    assert got[("c", "h")]["submissions"] == 2 and got[("c", "h")]["span_seconds"] == 2.0
