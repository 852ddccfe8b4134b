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
    assert (dup["client_id"], dup["submissions"], dup["preemptions"]) == ("team-a", 3, 3)
    assert run(store, "duplicate_submissions", window_s="1") == []  # 2 s apart: not within 1 s
    storms = run(store, "retry_storms")
    assert [s["client"] for s in storms] == ["team-b"]
    assert storms[0]["overload_answers"] == 6
