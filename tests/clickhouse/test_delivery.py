"""The ClickHouse sink when the store misbehaves: outages, a full spool, retried batches."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from clickhouse_connect.driver.exceptions import OperationalError
from prometheus_client import CollectorRegistry

from kvscope.rows import RequestTrace
from kvscope.sinks.base import SinkManager
from kvscope.sinks.metrics import SinkCollector
from kvscope.sinks.spool import Spool, SpooledBatch, SpoolLockedError
from kvscope.store import arrow, embedded
from kvscope.store.sink import ClickHouseSink, Target
from tests.clickhouse.conftest import FAST, clickhouse_connect, count
from tests.clickhouse.rowsource import SwitchableStore, trace
from tests.reliability.serveproc import wait_until

pytestmark = pytest.mark.clickhouse


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sink_for(dsn: str, database: str, spool: Path, **kw: Any) -> ClickHouseSink:
    return ClickHouseSink(dsn, database=database, spool_dir=str(spool),
                          options=kw.pop("options", FAST), **kw)


def test_rows_arrive_and_are_counted(store: Any, database: str, chdb_dsn: str,
                                     tmp_path: Path) -> None:
    sink = sink_for(chdb_dsn, database, tmp_path / "spool")
    for i in range(2500):
        sink.write("request_traces", trace(i))
    assert sink.flush(30)
    reg = CollectorRegistry()
    reg.register(SinkCollector(SinkManager([sink])))
    v = reg.get_sample_value
    labels = {"sink": "clickhouse", "table": "request_traces"}
    assert v("kvscope_sink_rows_written_total", labels) == 2500
    assert v("kvscope_sink_rows_dropped_total", labels) == 0
    assert v("kvscope_sink_errors_total", {"sink": "clickhouse"}) == 0
    assert v("kvscope_sink_spool_bytes", {"sink": "clickhouse"}) == 0
    assert v("kvscope_sink_oldest_unsent_age_seconds", {"sink": "clickhouse"}) == 0
    assert sink.close(10)
    assert count(store, "request_traces") == 2500
    row = store.query("SELECT ts, arrival_ts, contiguous_allocated FROM request_traces "
                      "WHERE request_id = 'r0000007'").result_rows[0]
    assert (row[0] - row[1]).total_seconds() == pytest.approx(1.0, abs=0.002)
    assert row[2] is True


@pytest.mark.twin
def test_outage_during_a_twin_run_loses_no_row(store: Any, database: str, chdb_dsn: str,
                                               tmp_path: Path, twin_runner: Any) -> None:
    flaky = SwitchableStore(lambda: clickhouse_connect.get_client(dsn=chdb_dsn))
    sink = sink_for(chdb_dsn, database, tmp_path / "spool", connect=flaky.connect)
    rows: list[Any] = []
    seen = {"spooled": 0, "down_at": -1, "up_at": -1}

    def outage(i: int) -> None:
        time.sleep(0.001)  # an engine step takes milliseconds, not the twin's microseconds
        if i == 100:
            flaky.down.set()
            seen["down_at"] = i
        elif flaky.down.is_set() and i % 20 == 0:
            st = sink.stats()
            seen["spooled"] = max(seen["spooled"], st.spool_batches)
            if st.errors >= 3 and st.spool_batches >= 3:  # retried, and rows wait on disk
                flaky.down.clear()
                seen["up_at"] = i

    manager = SinkManager([sink])
    hub, result = twin_runner(lambda r: (rows.append(r), manager.emit(r)), on_step=outage)
    assert 100 < seen["up_at"] < result.steps, seen  # the store came back during the run
    assert sink.flush(60)
    stats = sink.stats()
    assert sink.close(10)
    ended = sum(hub.engines["0"].counters.ends.values())
    traces = [r for r in rows if isinstance(r, RequestTrace)]
    assert ended == len(traces) == 80
    assert count(store, "request_traces") == ended
    assert int(store.command("SELECT uniqExact(request_id) FROM request_traces")) == ended
    assert count(store, "request_events") == sum(type(r).__name__ == "RequestEvent"
                                                 for r in rows)
    assert stats.errors >= 3 and seen["spooled"] >= 3
    assert stats.rows_written["request_traces"] == ended
    assert not any(stats.rows_dropped.values())


def test_unreachable_server_then_restart_on_the_store(store: Any, database: str,
                                                      chdb_dsn: str, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    dsn = f"http://kvuser:s3cr3t-pw@127.0.0.1:{closed_port()}/{database}"
    down = sink_for(dsn, database, tmp_path / "spool")
    for i in range(1500):
        down.write("request_traces", trace(i))
    assert not down.flush(1.0)  # spooled, not delivered
    st = down.stats()
    assert st.spool_batches >= 1 and st.spool_bytes > 0 and st.errors >= 1
    assert not st.connected and st.oldest_unsent_age_seconds > 0
    assert not down.close(0.5)
    assert "s3cr3t" not in st.last_error and "Connection refused" in st.last_error
    assert "s3cr3t" not in caplog.text and "delivery failed" in caplog.text
    # the sidecar comes back pointed at a reachable store, same spool: it replays. The old
    # sink's close may have left an attempt running on a busy machine; a new process would
    # not start before the old one ended, and here the spool is free once that attempt ends.
    wait_until("the old sink to let its spool go", lambda: spool_is_free(tmp_path / "spool"),
               30)
    up = sink_for(chdb_dsn, database, tmp_path / "spool")
    assert up.flush(30)
    assert up.stats().rows_written["request_traces"] == 1500
    assert up.close(5)
    assert count(store, "request_traces") == 1500


def test_an_idle_sink_reports_its_store_as_it_is(store: Any, database: str, chdb_dsn: str,
                                               tmp_path: Path) -> None:
    """`connected` is what the sink last saw of its store, rows or none: 0 before it has
    looked, 0 within a check when the store is down at start (an idle engine sends no row),
    1 when it is up, and it follows the store while no row flows."""
    dsn = f"http://127.0.0.1:{closed_port()}/{database}"
    opts = replace(FAST, check_interval_s=0.2)
    down = sink_for(dsn, database, tmp_path / "down", options=opts)
    try:
        assert down.stats().connected is False  # nothing seen yet
        wait_until("a check of the closed port", lambda: down.stats().errors >= 1, 30)
        st = down.stats()
        assert st.connected is False and "Connection refused" in st.last_error
        assert st.spool_batches == 0 and not any(st.rows_written.values())
    finally:
        down.close(0.5)
    flaky = SwitchableStore(lambda: clickhouse_connect.get_client(dsn=chdb_dsn))
    up = sink_for(chdb_dsn, database, tmp_path / "up", options=opts, connect=flaky.connect)
    try:
        wait_until("the first check of a reachable store", lambda: up.stats().connected, 30)
        assert up.stats().errors == 0
        flaky.down.set()
        wait_until("an idle check to see the store go", lambda: not up.stats().connected, 30)
        flaky.down.clear()
        wait_until("an idle check to see it back", lambda: up.stats().connected, 30)
        assert not any(up.stats().rows_written.values())
    finally:
        assert up.close(5)


def test_dsn_credentials_never_shown() -> None:
    t = Target.parse("https://admin:hunter2@ch.example:8443/prod?password=hunter2")
    assert "hunter2" not in t.safe and t.database == "prod"
    assert "hunter2" not in t.scrub("failed for hunter2 at https://admin:hunter2@ch")
    with pytest.raises(ValueError) as err:
        ClickHouseSink("ftp://admin:hunter2@h")
    assert "hunter2" not in str(err.value)
    with pytest.raises(ValueError, match="chdb:///absolute/path"):
        ClickHouseSink("chdb://relative/dir")


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_full_spool_drops_by_policy_and_counts(store: Any, database: str, chdb_dsn: str,
                                               tmp_path: Path, policy: str) -> None:
    flaky = SwitchableStore(lambda: clickhouse_connect.get_client(dsn=chdb_dsn))
    flaky.down.set()
    # The batch the sending thread is trying is in flight and cannot be dropped (its file is
    # being read). With the test's fast backoff that thread re-took the oldest batch every
    # few ms, so on a loaded machine the spool sometimes overflowed during a try and the
    # oldest batch outlived drop_oldest (a CI run: rows 0-99 stored). Now the first batch
    # is written alone and the rest only once the thread has failed it (after its look at
    # the store at start): it then waits 5 s, and the overflows find no batch in flight.
    opts = replace(FAST, batch_rows=100, max_queue_rows=100_000, spool_max_bytes=64 << 10,
                   spool_policy=policy, backoff_initial_s=5.0, backoff_max_s=5.0)
    sink = sink_for(chdb_dsn, database, tmp_path / "spool", options=opts,
                    connect=flaky.connect)
    for i in range(100):
        sink.write("request_traces", trace(i))
    wait_until("the look and the first batch failed", lambda: sink.delivery.send_errors >= 2,
               10.0)
    for i in range(100, 2000):
        sink.write("request_traces", trace(i))
    assert not sink.flush(0.5)
    st = sink.stats()
    spooled = sink.spool.pending_rows()["request_traces"]
    assert st.rows_dropped["request_traces"] + spooled == 2000
    assert st.rows_dropped["request_traces"] >= 1000 and spooled >= 100
    assert st.spool_bytes <= 64 << 10
    flaky.down.clear()
    assert sink.flush(30)
    assert sink.close(5)
    stored = {r[0] for r in store.query("SELECT prompt_len FROM request_traces").result_rows}
    assert len(stored) == spooled == sink.stats().rows_written["request_traces"]
    newest, oldest = set(range(1900, 2000)), set(range(100))
    assert (newest <= stored) if policy == "drop_oldest" else (oldest <= stored)
    assert not (oldest & stored) if policy == "drop_oldest" else not (newest & stored)


def test_same_token_is_stored_once(store: Any, database: str, chdb_dsn: str,
                                   tmp_path: Path) -> None:
    sink = sink_for(chdb_dsn, database, tmp_path / "spool")
    payload = arrow.encode("request_traces", [trace(i) for i in range(300)])
    batch = SpooledBatch(1, "request_traces", 300, time.time(), "tok-a", len(payload))
    sink._send(batch, payload, 0)
    sink._send(batch, payload, 1)  # a retry after a lost answer
    assert count(store, "request_traces") == 300
    sink._send(replace(batch, token="tok-b"), payload, 0)  # the token, not the content
    assert count(store, "request_traces") == 600
    assert sink.close(5)


def test_batch_inserted_before_a_crash_is_replayed_once(store: Any, database: str,
                                                        chdb_dsn: str, tmp_path: Path) -> None:
    """The crash window of write-ahead: the store took the batch, the process died before
    deleting it from the spool. The next start sends it again with the same token."""
    rows = [trace(i) for i in range(500)]
    payload = arrow.encode("request_traces", rows)
    spool = Spool(str(tmp_path / "spool"))
    batch = spool.put("request_traces", 500, time.time(), "crash-token", payload)
    spool.close()
    first = sink_for(chdb_dsn, database, tmp_path / "other-spool")
    assert batch is not None
    first._send(batch, payload, 0)  # inserted by the process that then died
    assert first.close(5)
    assert count(store, "request_traces") == 500
    again = sink_for(chdb_dsn, database, tmp_path / "spool")
    assert again.flush(30) and again.stats().rows_written["request_traces"] == 500
    assert again.close(5)
    assert count(store, "request_traces") == 500


def hanging_sink(database: str, chdb_dsn: str, spool: Path,
                 ) -> tuple[ClickHouseSink, threading.Event]:
    """A sink with one row whose store's connect is hanging (a server that accepts the
    connection and never answers) until the event returned is set."""
    entered, release = threading.Event(), threading.Event()

    def hang() -> Any:
        entered.set()
        release.wait()
        raise OperationalError("read timed out")

    sink = sink_for(chdb_dsn, database, spool, connect=hang)
    sink.write("request_traces", trace(0, ts=1e9))
    assert entered.wait(60), "the sink never tried its store"
    return sink, release


def test_write_never_blocks_while_the_store_hangs(database: str, chdb_dsn: str,
                                                  tmp_path: Path) -> None:
    """Every write returns while the store's connect is still hanging, and it hangs until
    the test lets it go: no write can have waited for the store."""
    sink, release = hanging_sink(database, chdb_dsn, tmp_path / "spool")
    rows = [trace(i, ts=1e9) for i in range(1, 50_000)]
    written = threading.Event()

    def write_all() -> None:
        for row in rows:
            sink.write("request_traces", row)
        written.set()

    writer = threading.Thread(target=write_all, name="writer", daemon=True)
    writer.start()
    # A deadline to report a blocked writer instead of hanging the suite; not a bound.
    assert written.wait(300), "a write waited for the store"
    assert sink.flush(1.0) is False  # not delivered
    deadline = time.monotonic() + 60  # spooling 50,000 rows takes a while on a busy machine
    while sink.spool.pending_rows()["request_traces"] < 50_000 and time.monotonic() < deadline:
        time.sleep(0.1)
    # every row waits in the spool (batch boundaries depend on timing; the rows do not)
    assert sink.spool.pending_rows() == {"request_traces": 50_000}
    assert sink.stats().rows_dropped.get("request_traces", 0) == 0
    release.set()
    sink.close(0.3)


def spool_is_free(directory: Path) -> bool:
    """Whether another owner may take ``directory`` now (taken and let go at once)."""
    try:
        Spool(str(directory)).close()
    except SpoolLockedError:
        return False
    return True


def test_a_close_that_times_out_lets_the_spool_go_when_the_insert_ends(
        database: str, chdb_dsn: str, tmp_path: Path) -> None:
    """``close`` cannot wait out an insert that hangs; the spool stays locked only while
    that insert runs, and the sending thread lets it go as it leaves, so another owner in
    this process (a sink started again, a test) takes the spool once the insert ends."""
    sink, release = hanging_sink(database, chdb_dsn, tmp_path / "spool")
    assert sink.close(0.3) is False
    assert not spool_is_free(tmp_path / "spool")  # the insert still runs: still its owner
    release.set()
    wait_until("the closed sink to let its spool go", lambda: spool_is_free(tmp_path / "spool"),
               30)
    after = Spool(str(tmp_path / "spool"))
    assert after.pending_rows() == {"request_traces": 1}  # the row waits for the next start
    after.close()


def test_a_fresh_reader_sees_every_row_taken_before_it_whatever_the_batch_interval(
        store: Any, database: str, chdb_dsn: str, tmp_path: Path) -> None:
    """explain reads through ``fresh_reader``: a request that ended just now is in the
    store at once, though the sink gathers rows for a minute before an insert."""
    sink = sink_for(chdb_dsn, database, tmp_path / "spool",
                    options=replace(FAST, batch_interval_s=60.0))

    def stored() -> int:
        reader = sink.fresh_reader()
        try:
            return count(reader, "request_traces")
        finally:
            reader.close()

    try:
        sink.write("request_traces", trace(1))
        assert stored() == 1
        # A second reader within the same second shares that flush: no insert forced
        sink.write("request_traces", trace(2))
        assert stored() == 1
        assert sink.stats().rows_written["request_traces"] == 1
    finally:
        assert sink.close(10)
    assert count(store, "request_traces") == 2


def spooled_in_bursts(sink: ClickHouseSink, bursts: int, rows: int, start: int = 0) -> int:
    """``bursts`` batches of ``rows`` traces, each written once the one before is spooled;
    returns the next row number."""
    i = start
    for _ in range(bursts):
        for _ in range(rows):
            sink.write("request_traces", trace(i))
            i += 1
        wait_until("a batch spooled", lambda: sink.stats().queued_rows == 0, 30)
    return i



def counting_sends(monkeypatch: pytest.MonkeyPatch,
                   lost_answer: Callable[[ClickHouseSink], object] | None = None
                   ) -> list[SpooledBatch]:
    """Every batch the sinks made from now on send, in order. With ``lost_answer``, the
    first insert lands in the store, then ``lost_answer(sink)`` runs and the sender sees an
    error."""
    sent: list[SpooledBatch] = []
    send = ClickHouseSink._send

    def spy(self: ClickHouseSink, batch: SpooledBatch, payload: bytes, attempt: int) -> None:
        sent.append(batch)
        send(self, batch, payload, attempt)
        if lost_answer is not None and len(sent) == 1:
            lost_answer(self)
            raise OperationalError("the answer was lost")

    monkeypatch.setattr(ClickHouseSink, "_send", spy)
    return sent


def test_a_tables_spooled_batches_go_to_the_store_as_one_insert(
        store: Any, database: str, chdb_dsn: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch is on disk after the batch interval; the store takes them together once the
    insert interval has passed (or a flush asks), each row once."""
    sent = counting_sends(monkeypatch)
    sink = sink_for(chdb_dsn, database, tmp_path / "spool",
                    options=replace(FAST, insert_interval_s=600.0))
    n = spooled_in_bursts(sink, 5, 200)
    assert len(sink.spool) == 5 and sent == []  # durable, waiting for the interval
    assert sink.flush(30)
    assert [(b.rows, b.covers is not None) for b in sent] == [(1000, True)]
    assert sink.stats().rows_written["request_traces"] == 1000
    sink.delivery.opt = replace(sink.delivery.opt, insert_interval_s=1.0)
    n = spooled_in_bursts(sink, 3, 100, n)  # then nothing asks: the interval passes
    wait_until("rows delivered", lambda: sink.stats().rows_written["request_traces"] == n, 60)
    assert sum(b.rows for b in sent) == n
    assert sink.close(10)
    assert store.query("SELECT count(), uniqExact(request_id) FROM request_traces"
                       ).result_rows[0] == (n, n)


@pytest.mark.parametrize("before", ["spooled by a process that died", "its answer lost"])
def test_a_batch_the_store_may_hold_is_sent_again_alone_with_its_token(
        before: str, store: Any, database: str, chdb_dsn: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Never inside a new combined batch: its rows would then be stored twice."""
    n = 0
    if before == "spooled by a process that died":
        n = 300
        spool = Spool(str(tmp_path / "spool"))
        spool.put("request_traces", n, time.time(), "from-before",
                  arrow.encode("request_traces", [trace(i) for i in range(n)]))
        spool.close()
    gate = threading.Event()  # the store is reached once the batches are spooled

    def connect() -> Any:
        gate.wait(30)
        return embedded.connect(chdb_dsn, True)

    more = 100 if before == "its answer lost" else 0  # spooled while the sender backs off
    sent = counting_sends(monkeypatch, lambda sink: spooled_in_bursts(sink, 1, more, n + 200))
    sink = sink_for(chdb_dsn, database, tmp_path / "spool", connect=connect,
                    options=replace(FAST, insert_interval_s=600.0))
    n = spooled_in_bursts(sink, 2, 100, n) + more
    gate.set()
    assert sink.flush(30)
    assert sent[0].token == sent[1].token and sent[0].rows == sent[1].rows
    assert sum(b.rows for b in sent[1:]) == n
    assert sink.close(10)
    assert store.query("SELECT count(), uniqExact(request_id) FROM request_traces"
                       ).result_rows[0] == (n, n)


def test_batches_waiting_to_be_combined_go_at_once_when_the_clock_goes_back(
        store: Any, database: str, chdb_dsn: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait is never longer than the insert interval: an hour back on the wall clock
    must not hold the rows an hour."""
    sink = sink_for(chdb_dsn, database, tmp_path / "spool",
                    options=replace(FAST, insert_interval_s=600.0))
    spooled_in_bursts(sink, 2, 100)
    import kvscope.sinks.delivery as delivery

    wall = time.time
    monkeypatch.setattr(delivery, "time", SimpleNamespace(
        time=lambda: wall() - 3600, monotonic=time.monotonic, sleep=time.sleep))
    sink.delivery._spooled.set()  # as the next spooled batch would
    wait_until("rows delivered", lambda: sink.stats().rows_written["request_traces"] == 200,
               30)
    assert sink.close(10)
    assert count(store, "request_traces") == 200
