"""Integer list columns read from Python lists through one machine-int buffer encode to
exactly what pyarrow's own conversion makes of them, or fail as it does."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvscope.rows import RequestAllocations
from kvscope.store import arrow


def allocations(rid: str, n: int, base: int) -> RequestAllocations:
    col = [base + 7 * i for i in range(n)]
    return RequestAllocations(ts=1_700_000_000.0 + n, model="m", engine="0", request_id=rid,
                              step=col, offset_ms=[i * 3 for i in range(n)], blocks=[1] * n,
                              total_blocks=col[::-1], free_blocks=[-1] * n, tokens=col)


def pyarrows_own(rows: list[RequestAllocations]) -> pa.RecordBatch:
    """The batch as ``pa.array`` converts every column, the list columns included."""
    schema = arrow.arrow_schema("request_allocations")
    cols = []
    for f in schema:
        values = [getattr(r, f.name) for r in rows]
        if f.type == arrow.TIMESTAMP:
            values = [round(v * 1000) for v in values]
        cols.append(pa.array(values, type=f.type))
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def test_allocation_lists_encode_as_pyarrow_converts_them() -> None:
    rows = [allocations("a", 30, 100), allocations("b", 0, 0), allocations("c", 1, -5),
            allocations("d", 64, 2**62), allocations("e", 3, -(2**63))]
    rows[3] = RequestAllocations(**{**{f: getattr(rows[3], f) for f in
                                       arrow.arrow_schema("request_allocations").names},
                                    "tokens": [2**63 - 1] * 64})
    got = arrow.to_record_batch("request_allocations", rows)
    assert got.equals(pyarrows_own(rows))
    assert got.column("tokens").to_pylist()[3] == [2**63 - 1] * 64
    assert [len(v) for v in got.column("step").to_pylist()] == [30, 0, 1, 64, 3]
    read = pa.ipc.open_file(arrow.encode("request_allocations", rows)).read_all()
    assert read.to_batches()[0].equals(got)


@pytest.mark.parametrize(("bad", "error"), [("7", TypeError), (2**63, OverflowError),
                                            (1.5, TypeError)])
def test_a_value_that_is_no_int64_fails_the_batch(bad: object, error: type) -> None:
    """As pyarrow's conversion fails, except that 1.5 fails too (pyarrow stores 1): a batch
    the tracker built wrong is refused whole and counted, never stored altered."""
    row = allocations("a", 4, 1)
    broken = RequestAllocations(**{**{f: getattr(row, f) for f in
                                      arrow.arrow_schema("request_allocations").names},
                                   "blocks": [1, 1, bad, 1]})
    with pytest.raises(error):
        arrow.to_record_batch("request_allocations", [row, broken])
    if isinstance(bad, float):
        assert pyarrows_own([row, broken]).column("blocks").to_pylist()[1] == [1, 1, 1, 1]
    else:
        with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)):
            pyarrows_own([row, broken])


def test_a_layout_rows_per_block_columns_go_at_the_stores_width() -> None:
    """states UInt8, block_group Int8, owner UInt32 (050_layout_snapshots.sql): a quarter
    of the bytes int64 took, the values unchanged, from numpy arrays or Python lists."""
    import dataclasses

    import numpy as np

    from kvscope.rows import LayoutSnapshotRow

    n = 1000
    lists = LayoutSnapshotRow(
        ts=1_700_000_000.0, model="m", engine="0", session="s", step=7, num_blocks=n,
        free_blocks=1, cached_blocks=1, used_blocks=1, max_contiguous_free=1,
        budget_utilization=0.5, running=1, waiting=0, kv_group_kinds=["FullAttentionSpec"],
        states=[i % 4 for i in range(n)], block_group=[(i % 3) - 1 for i in range(n)],
        owner=[i * 4_000_000 for i in range(n)], owner_req_ids=["r"], owner_blocks=[3],
        owner_fragments=[1], owner_group_runs=[[[5, 3]]])
    arrays = dataclasses.replace(lists, states=np.array(lists.states, np.uint8),
                                 block_group=np.array(lists.block_group, np.int8),
                                 owner=np.array(lists.owner, np.uint32))
    for row in (lists, arrays):
        got = arrow.to_record_batch("layout_snapshots", [row])
        assert [got.schema.field(c).type.value_type for c in ("states", "block_group", "owner")
                ] == [pa.uint8(), pa.int8(), pa.uint32()]
        assert got.column("states").to_pylist() == [lists.states]
        assert got.column("block_group").to_pylist() == [lists.block_group]
        assert got.column("owner").to_pylist() == [lists.owner]
    too_big = dataclasses.replace(arrays, states=np.array([0, 1, 300], np.int64))
    with pytest.raises(pa.ArrowInvalid, match="300"):
        arrow.to_record_batch("layout_snapshots", [too_big])
    with pytest.raises(pa.ArrowInvalid):
        arrow.to_record_batch("layout_snapshots", [dataclasses.replace(lists, owner=[-1])])
