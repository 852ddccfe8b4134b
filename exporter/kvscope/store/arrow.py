"""Rows to Arrow IPC (ClickHouse's ``FORMAT Arrow``): the bytes kvscope spools and sends.

Column types follow the row dataclasses: ``int`` -> int64, ``float`` -> float64, ``str`` ->
string, ``bool`` -> bool; ClickHouse casts them to the narrower column types on insert,
except the per-block columns in ``NARROW``, sent at the store's own width.
Float epoch seconds named ``ts`` or ``*_ts`` become ``timestamp[ms, UTC]`` for the
``DateTime64(3, 'UTC')`` columns, rounded to the millisecond.
"""

from __future__ import annotations

import functools
import operator
from array import array
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import pyarrow as pa

from kvscope.rows import TABLES

TIMESTAMP = pa.timestamp("ms", tz="UTC")
_TYPES = {"int": pa.int64(), "float": pa.float64(), "str": pa.string(), "bool": pa.bool_(),
          "list[int]": pa.list_(pa.int64()), "list[str]": pa.list_(pa.string()),
          "list[list[list[int]]]": pa.list_(pa.list_(pa.list_(pa.int64())))}


NARROW: dict[str, dict[str, pa.DataType]] = {
    "layout_snapshots": {"states": pa.uint8(), "block_group": pa.int8(), "owner": pa.uint32()},
}
"""Integer list columns sent at the store's own width (clickhouse/schema/050), not int64:
a layout row's three per-block arrays, 131,072 entries each at 128k blocks, were 3.1 MB of
the batch as int64 and are 0.8 MB so, in every copy the spool, the combined insert and the
store make of it. A value out of the narrow type's range fails the batch (pyarrow checks
it), as an int64 overflow does."""


def is_time(column: str) -> bool:
    return column == "ts" or column.endswith("_ts")


@functools.cache
def arrow_schema(table: str) -> pa.Schema:
    out = []
    narrow = NARROW.get(table, {})
    for f in fields(TABLES[table]):
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        typ = (TIMESTAMP if is_time(f.name) else
               pa.list_(narrow[f.name]) if f.name in narrow else _TYPES[kind])
        out.append(pa.field(f.name, typ, nullable=False))
    return pa.schema(out)


@functools.cache
def _getters(table: str) -> list[Callable[[Any], Any]]:
    return [operator.attrgetter(name) for name in arrow_schema(table).names]


def to_record_batch(table: str, rows: Sequence[Any]) -> pa.RecordBatch:
    # One C-level pass per column: no per-row tuple, so no garbage-collector churn.
    schema = arrow_schema(table)
    arrays = []
    for f, get in zip(schema, _getters(table), strict=True):
        col = list(map(get, rows))
        if f.type == TIMESTAMP:
            ms = np.rint(np.asarray(col, dtype=np.float64) * 1000.0).astype(np.int64)
            arrays.append(pa.array(ms, type=TIMESTAMP))
        elif col and pa.types.is_list(f.type) and pa.types.is_integer(f.type.value_type):
            if all(type(v) is list for v in col):
                arrays.append(_list_of_ints(col, f.type))
            elif all(isinstance(v, np.ndarray) for v in col):
                arrays.append(_list_of_arrays(col, f.type))
            else:
                arrays.append(pa.array(col, type=f.type))
        else:
            arrays.append(pa.array(col, type=f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _list_of_arrays(col: list[np.ndarray], typ: pa.ListType) -> pa.Array:
    """A list column whose values are numpy arrays (a layout row's per-block arrays, 131,072
    entries at 128k blocks), built from one concatenation: 0.9 ms for 8 such rows, where
    ``pa.array`` took 80 ms from the arrays and 21 ms from Python lists."""
    return _list_array(col, typ, lambda: np.concatenate(col))


def _list_of_ints(col: list[list[int]], typ: pa.ListType) -> pa.Array:
    """A list column whose values are lists of Python ints (a ``request_allocations`` row's
    six arrays, ~30 entries each), read into one machine-int buffer by ``array.fromlist``:
    1.9 ms for 762 rows' six columns, where ``pa.array`` took 4.1 ms reading each int
    through its generic converter. A value that is not an int (a float too, which
    ``pa.array`` stored truncated) or out of int64's range raises TypeError or
    OverflowError where ``pa.array`` raised ArrowInvalid, and one out of a ``NARROW``
    column's range ArrowInvalid; a bool passes as 0 or 1."""

    def values() -> np.ndarray:
        flat = array("q")
        for v in col:
            flat.fromlist(v)
        return np.frombuffer(flat, np.int64)

    return _list_array(col, typ, values)


def _list_array(col: Sequence[Any], typ: pa.ListType,
                values: Callable[[], np.ndarray]) -> pa.Array:
    """``col``'s values, flattened by ``values()``, as one list array; pyarrow casts them to
    the column's type, range checked."""
    offsets = np.zeros(len(col) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, col), np.int64, len(col)), out=offsets[1:])
    if offsets[-1] >= 2**31:  # past a list array's int32 offsets: let pyarrow say so
        return pa.array(col, type=typ)
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                    pa.array(values(), type=typ.value_type))


def encode(table: str, rows: Sequence[Any]) -> pa.Buffer:
    """One Arrow IPC file holding these rows of ``table``."""
    batch = to_record_batch(table, rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue()


def concat(payloads: Sequence[bytes | pa.Buffer]) -> pa.Buffer:
    """One Arrow IPC file holding the record batches of ``payloads`` (files of ``encode``,
    one table's), in order, without decoding a row; raises ``ValueError`` when their
    columns differ (batches spooled by versions with other columns)."""
    readers = [pa.ipc.open_file(pa.py_buffer(p)) for p in payloads]
    schema = readers[0].schema
    for r in readers[1:]:
        if not r.schema.equals(schema):
            raise ValueError(f"columns differ: {schema.names} and {r.schema.names}")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for r in readers:
            for i in range(r.num_record_batches):
                writer.write_batch(r.get_batch(i))
    return sink.getvalue()


def use_system_allocator() -> None:
    """Make the C library's allocator pyarrow's (a process-wide setting; the store is its
    only user in the sidecar). pyarrow's default, mimalloc, hands a batch's buffers back to
    the kernel soon after they are freed, so every batch sealed (each table every 5 s) and
    every insert's combined payload faulted its memory in again, zeroed page by page: half
    of the batching thread's time in the kernel's ``clear_page``
    (benchmarks/README.md, "twentieth pass"). The C library keeps freed memory for the
    next batch: the store's two threads took ~20% less CPU, and the process less memory."""
    pa.set_memory_pool(pa.system_memory_pool())


def warm(tables: Sequence[str]) -> None:
    """Encode an empty batch of each table: pyarrow imports pandas (~400 modules, ~0.2 s of
    CPU) at its first conversion from numpy, and that should happen as the sidecar starts,
    not in the batching thread while the first engine's rows arrive."""
    for table in tables:
        encode(table, [])


def column_names(payload: bytes | pa.Buffer) -> list[str]:
    """Columns of a spooled batch, read from its own footer (older batches replay as written)."""
    return pa.ipc.open_file(pa.py_buffer(payload)).schema.names
