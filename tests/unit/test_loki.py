"""Pushing decisions to Loki: the payload, and an outage that loses and doubles nothing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response

from kvscope.decisions.loki import LokiSink, push_payload
from kvscope.localvllm.server import free_port
from kvscope.rows import SchedulerDecision
from kvscope.sinks.options import DeliveryOptions
from tests.reliability.serveproc import wait_until


def decision(i: int, event: str = "preempt", engine: str = "0") -> SchedulerDecision:
    return SchedulerDecision(ts=1_800_000_000.0 + i / 1000, model="tiny", engine=engine,
                             decision=event, request_id=f"r{i}", reason="kv_full",
                             blocks_needed=2, free_blocks=0, max_contiguous_free=0, tokens=64,
                             policy="fcfs", msg=f"Preempting request r{i} due to kv_full")


class FakeLoki:
    """Stands in for Loki's push endpoint: keeps entries as Loki does (one per stream,
    timestamp and line), answers a push of no streams 422 as Loki 3.2 on does, and 503
    while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.pushes = 0
        self.entries: set[tuple[str, str, str]] = set()
        self.headers: dict[str, str] = {}
        app = FastAPI()

        @app.post("/loki/api/v1/push")
        async def push(request: Request) -> Response:
            self.pushes += 1
            if self.down:
                return Response(status_code=503)
            self.headers = dict(request.headers)
            streams = (await request.json())["streams"]
            if not streams:
                return Response(status_code=422, content=b"error at least one valid stream "
                                b"is required for ingestion")
            for s in streams:
                labels = json.dumps(s["stream"], sort_keys=True)
                for ts, line in s["values"]:
                    self.entries.add((labels, ts, line))
            return Response(status_code=204)

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeLoki:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(5)


def test_payload_groups_streams_by_engine_and_event() -> None:
    body = json.loads(push_payload([decision(1), decision(2, "finish"), decision(3)]))
    streams = {(s["stream"]["engine"], s["stream"]["event"]): s for s in body["streams"]}
    assert set(streams) == {("0", "preempt"), ("0", "finish")}
    assert streams[("0", "preempt")]["stream"]["job"] == "kvscope"
    ts, line = streams[("0", "preempt")]["values"][0]
    assert ts == str(int((1_800_000_000.0 + 0.001) * 1e9))
    assert json.loads(line)["msg"].startswith("Preempting request r1")


def test_an_outage_spools_and_replays_every_decision_once(tmp_path: Path) -> None:
    opts = DeliveryOptions(batch_rows=10, batch_interval_s=0.1, backoff_initial_s=0.05,
                           backoff_max_s=0.2, fsync=False)
    with FakeLoki() as loki:
        sink = LokiSink(f"http://127.0.0.1:{loki.port}", str(tmp_path / "spool"),
                        tenant="team-a", options=opts)
        try:
            loki.down = True
            for i in range(50):
                sink.write("scheduler_decisions", decision(i))
            deadline = time.monotonic() + 10
            while sink.stats().errors < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sink.stats().errors >= 2 and not loki.entries
            loki.down = False
            for i in range(50, 60):
                sink.write("scheduler_decisions", decision(i))
            assert sink.flush(15)
        finally:
            sink.close(5)
    assert len(loki.entries) == 60
    assert loki.headers.get("x-scope-orgid") == "team-a"
    stats = sink.stats()
    assert sum(stats.rows_written.values()) == 60 and sum(stats.rows_dropped.values()) == 0


def test_an_idle_sink_reports_whether_loki_answers(tmp_path: Path) -> None:
    opts = DeliveryOptions(batch_interval_s=0.1, backoff_initial_s=0.05, backoff_max_s=0.2,
                           fsync=False, check_interval_s=0.1)
    with FakeLoki() as loki:
        sink = LokiSink(f"http://127.0.0.1:{loki.port}", str(tmp_path / "spool"), options=opts)
        try:
            assert sink.stats().connected is False  # nothing seen yet
            wait_until("the first look at Loki", lambda: sink.stats().connected, 30)
            loki.down = True
            wait_until("a look to see Loki answer 503", lambda: not sink.stats().connected, 30)
            assert sink.stats().last_error.startswith("HTTPStatusError pushing to http")
            loki.down = False
            wait_until("a look to see it back", lambda: sink.stats().connected, 30)
        finally:
            sink.close(5)
    assert not loki.entries and sum(sink.stats().rows_written.values()) == 0
