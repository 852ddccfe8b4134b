"""Spooled batches combined into one insert keep every row, in order, or are refused whole."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvscope.store import arrow
from tests.clickhouse.rowsource import trace


def test_combined_batches_hold_every_row_in_order() -> None:
    rows = [trace(i, ts=1e9 + i) for i in range(7)]
    whole = arrow.concat([arrow.encode("request_traces", rows[:3]),
                          arrow.encode("request_traces", rows[3:4]),
                          arrow.encode("request_traces", rows[4:])])
    got = pa.ipc.open_file(whole).read_all()
    assert got.equals(pa.ipc.open_file(arrow.encode("request_traces", rows)).read_all())
    assert arrow.column_names(whole) == arrow.column_names(
        arrow.encode("request_traces", rows))


def test_batches_with_other_columns_are_not_combined() -> None:
    older = pa.ipc.open_file(arrow.encode("request_traces", [trace(1)])).read_all()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, older.schema.remove(2)) as w:  # a version without a column
        w.write_table(older.remove_column(2))
    with pytest.raises(ValueError, match="columns differ"):
        arrow.concat([arrow.encode("request_traces", [trace(2)]), sink.getvalue()])
