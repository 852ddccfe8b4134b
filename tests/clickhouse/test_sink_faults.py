"""The ClickHouse sink when one batch, the schema or the disk is at fault: one bad thing
never blocks or loses the rows around it, and every row given up is counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from kvscope.store import arrow
from kvscope.store.sink import ClickHouseSink
from tests.clickhouse.conftest import FAST, clickhouse_connect, count
from tests.clickhouse.rowsource import trace
from tests.reliability.serveproc import wait_until

pytestmark = pytest.mark.clickhouse

TOKEN = "0123456789abcdef0123456789abcdef"


def sink_for(dsn: str, database: str, spool: Path, **kw: Any) -> ClickHouseSink:
    return ClickHouseSink(dsn, database=database, spool_dir=str(spool),
                          options=kw.pop("options", FAST), **kw)


def five_written_three_dropped(sink: ClickHouseSink, table: str) -> Any:
    """Five traces written behind a spooled batch of three ``table`` rows that cannot be
    stored: the five stored, the three counted dropped, the sink closed; its stats."""
    try:
        for i in range(5):
            sink.write("request_traces", trace(i))
        assert sink.flush(10)
        st = sink.stats()
        assert st.rows_dropped[table] == 3
        assert st.rows_written["request_traces"] == 5
    finally:
        closed = sink.close(10)
    assert closed
    return st


def test_a_damaged_spooled_batch_is_dropped_and_counted_not_retried_forever(
        store: Any, database: str, chdb_dsn: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    name = f"000000000001.step_stats.3.1700000000000.{TOKEN}.batch"
    (spool / name).write_bytes(b"ARROW1\0\0trunc")  # cut short on a disk that lied
    st = five_written_three_dropped(sink_for(chdb_dsn, database, spool), "step_stats")
    assert st.spool_batches == 0 and not (spool / name).exists()
    assert count(store, "request_traces") == 5
    dropped = [r for r in caplog.records if "dropped a batch" in r.getMessage()]
    assert len(dropped) == 1 and name in dropped[0].getMessage()


def with_extra_column(payload: Any) -> pa.Buffer:
    """The batch as a newer kvscope spooled it: one more column than this table has."""
    batch = pa.ipc.open_file(pa.py_buffer(payload)).get_batch(0)
    batch = batch.append_column("added_later", pa.array([1] * batch.num_rows, pa.int64()))
    out = pa.BufferOutputStream()
    with pa.ipc.new_file(out, batch.schema) as writer:
        writer.write_batch(batch)
    return out.getvalue()


def test_a_batch_with_a_column_the_table_lacks_is_dropped_once_the_ddl_did_not_help(
        store: Any, database: str, chdb_dsn: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    payload = with_extra_column(arrow.encode("request_traces",
                                             [trace(100 + i) for i in range(3)]))
    name = f"000000000001.request_traces.3.1700000000000.{TOKEN}.batch"
    (spool / name).write_bytes(payload.to_pybytes())  # spooled before a rollback
    five_written_three_dropped(sink_for(chdb_dsn, database, spool), "request_traces")
    assert sorted(r[0] for r in store.query("SELECT prompt_len FROM request_traces")
                  .result_rows) == [0, 1, 2, 3, 4]


class _FailingDDL:
    """A real chDB client whose server refuses one DDL statement for good (an older
    server's UNKNOWN_SETTING, another sidecar migrating at the same moment)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.refused = 0

    def command(self, cmd: str, *args: Any, **kwargs: Any) -> Any:
        if cmd.lstrip().startswith("CREATE OR REPLACE VIEW"):
            self.refused += 1
            raise DatabaseError("Code: 115. DB::Exception: Unknown setting. (UNKNOWN_SETTING)",
                                code=115)
        return self._client.command(cmd, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_a_schema_that_cannot_be_applied_keeps_the_rows_spooled(
        store: Any, database: str, chdb_dsn: str, tmp_path: Path) -> None:
    made: list[_FailingDDL] = []

    def connect() -> Any:
        made.append(_FailingDDL(clickhouse_connect.get_client(dsn=chdb_dsn)))
        return made[-1]

    sink = sink_for(chdb_dsn, database, tmp_path / "spool", connect=connect)
    try:
        for i in range(4):
            sink.write("request_traces", trace(i))
        # far more failed attempts than a batch the store refuses is allowed
        wait_until("eight failed connects", lambda: sum(c.refused for c in made) >= 8, 60)
        st = sink.stats()
        assert st.rows_dropped["request_traces"] == 0
        assert sink.spool.pending_rows()["request_traces"] == 4
        assert not st.connected and "UNKNOWN_SETTING" in st.last_error
    finally:
        assert not sink.close(1)


def test_rows_the_spool_cannot_take_are_neither_reported_delivered_nor_lost_uncounted(
        database: str, chdb_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from kvscope.sinks.spool import Spool

    def disk_full(self: Spool, batch: Any, payload: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Spool, "_write", disk_full)
    sink = sink_for(chdb_dsn, database, tmp_path / "spool")
    for i in range(7):
        sink.write("request_traces", trace(i))
    assert sink.flush(2) is False
    assert sink.stats().queued_rows == 7
    assert sink.close(1) is False
    st = sink.stats()
    assert st.queued_rows == 0 and st.rows_dropped["request_traces"] == 7
    assert not any(st.rows_written.values())
    assert "closing with 7 request_traces rows never spooled" in caplog.text
