"""Reads through the sidecar's API while the store is slow or away: readers in a burst
share one flush, and none waits behind the writer's connect."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvscope.explain.api import explain_router
from kvscope.store import sink as sink_module
from kvscope.store.sink import ClickHouseSink
from tests.clickhouse.conftest import FAST
from tests.reliability.serveproc import wait_until

pytestmark = pytest.mark.clickhouse


def test_readers_queued_behind_a_slow_flush_share_it(
        database: str, chdb_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five readers arrive while a flush to a stalled store runs (it takes 2 s of the
    sink's clock, twice the gap): one flush serves them all, not one each."""
    sink = ClickHouseSink(chdb_dsn, database=database, spool_dir=str(tmp_path / "spool"),
                          options=FAST)
    clock = [1000.0]
    monkeypatch.setattr(sink_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    flushes: list[float] = []
    entered, release = threading.Event(), threading.Event()

    def stalled_flush(timeout_s: float) -> bool:
        flushes.append(timeout_s)
        entered.set()
        release.wait(60)
        clock[0] += sink_module.FRESH_WAIT_S  # the flush ran out its wait
        return False

    monkeypatch.setattr(sink.delivery, "flush", stalled_flush)
    try:
        readers = [threading.Thread(target=sink.fresh, daemon=True) for _ in range(5)]
        readers[0].start()
        assert entered.wait(60)
        for r in readers[1:]:
            r.start()
        release.set()
        for r in readers:
            r.join(60)
        assert not any(r.is_alive() for r in readers)
        assert len(flushes) == 1
        clock[0] += sink_module.FRESH_GAP_S  # a reader after the gap flushes again
        sink.fresh()
        assert len(flushes) == 2
    finally:
        monkeypatch.undo()
        sink.close(5)


def test_a_read_does_not_wait_behind_the_writers_connect(
        database: str, chdb_dsn: str, tmp_path: Path) -> None:
    """The sending thread connects (and would run the DDL, a minute per statement at
    worst) holding the sink's lock; an API read answers 503 instead of queueing on it."""
    connecting, release = threading.Event(), threading.Event()

    def hanging_connect() -> Any:
        connecting.set()
        release.wait(120)
        raise OSError("connect timed out")

    sink = ClickHouseSink(chdb_dsn, database=database, spool_dir=str(tmp_path / "spool"),
                          options=FAST, connect=hanging_connect)
    app = FastAPI()
    app.include_router(explain_router(sink.fresh_reader))
    answers: list[Any] = []
    try:
        assert connecting.wait(60), "the sink never tried its store"
        reader = threading.Thread(
            target=lambda: answers.append(TestClient(app).get("/api/requests/r1")),
            daemon=True)
        reader.start()
        # A deadline to report a reader stuck behind the connect, not a bound on it.
        wait_until("the read's answer", lambda: bool(answers), 30)
        assert not release.is_set()  # the connect still hangs: the read did not wait for it
        assert answers[0].status_code == 503
        assert "store unavailable" in answers[0].json()["detail"]
    finally:
        release.set()
        sink.close(5)
