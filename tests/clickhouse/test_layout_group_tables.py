"""layout_snapshots keeps each request's table per KV group, and a store created before
that column existed gets it when kvscope starts (the schema's ALTER ... IF NOT EXISTS)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvscope.layout.history import clickhouse_history, layout_rows, to_row
from kvscope.layout.sampler import LayoutSampler
from kvscope.store import arrow, schema
from tests.unit.test_layout import F, N, U, pool

pytestmark = pytest.mark.clickhouse


def test_an_old_table_gains_the_column_and_the_tables_round_trip(store: Any,
                                                                  database: str) -> None:
    old = next(s for s in schema.render_schema(database, 30) if "layout_snapshots" in s
               and s.startswith("CREATE"))
    store.command(old.replace("    owner_fragments Array(UInt32) CODEC(ZSTD(3)),\n"
                              "    owner_group_runs Array(Array(Array(UInt32))) CODEC(ZSTD(3))",
                              "    owner_fragments Array(UInt32) CODEC(ZSTD(3))"))
    assert "owner_group_runs" not in columns(store, database)
    schema.apply_schema(store, database)
    assert "owner_group_runs" in columns(store, database)

    hub = pool([N, U, U, U, F], {"a": [[0, 0, 1], [2, 3]]}, {"a": 90}, groups=2)
    now = time.time()  # the table's TTL drops old rows at once
    (snap,) = LayoutSampler(hub).tick(now=now)
    payload = arrow.encode("layout_snapshots", [to_row(r) for r in layout_rows(snap)])
    store.raw_insert(f"{database}.layout_snapshots", arrow.column_names(payload),
                     payload.to_pybytes(), fmt="Arrow")  # as the sink inserts
    (back,) = clickhouse_history(lambda: store, database)("0", now - 1, now + 1, 10, 1000)
    assert [t.runs for t in back.owners[0].groups] == [((0, 2), (1, 1)), ((2, 2),)]


def columns(store: Any, database: str) -> list[str]:
    return [r[0] for r in store.query(
        "SELECT name FROM system.columns WHERE database = {db:String} "
        "AND table = 'layout_snapshots'", parameters={"db": database}).result_rows]


def test_the_stored_history_is_read_newest_first_until_the_answer_is_full(
        store: Any, database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer keeps the newest snapshots within ``max_runs``; the reader decoded every
    stored row up to ``limit`` first (3,600 rows of a 131,072-block pool: billions of
    entries). Now pages of ``CELLS_PER_READ`` block entries, newest first, stop once the
    runs pass the budget."""
    from kvscope.layout import history

    schema.apply_schema(store, database)
    hub = pool([N, U, U, U, F], {"a": [[0, 0, 1], [2, 3]]}, {"a": 90}, groups=2)
    now = time.time()
    sampler = LayoutSampler(hub)
    rows = []
    for i in range(40):
        (snap,) = sampler.tick(now=now - 40 + i)
        rows += [to_row(r) for r in layout_rows(snap)]
    payload = arrow.encode("layout_snapshots", rows)
    store.raw_insert(f"{database}.layout_snapshots", arrow.column_names(payload),
                     payload.to_pybytes(), fmt="Arrow")
    decoded = []

    class Counting:
        def query(self, sql: str, parameters: dict[str, Any]) -> Any:
            result = store.query(sql, parameters=parameters)
            decoded.append(len(result.result_rows))
            return result

    monkeypatch.setattr(history, "CELLS_PER_READ", 10)  # 2 rows a page of 5 blocks
    read = clickhouse_history(lambda: Counting(), database)
    per = read("0", now - 100, now, 100, 10**6)
    assert len(per) == 40 and [s.ts for s in per] == sorted(s.ts for s in per)
    runs = per[-1].runs.shape[0]
    decoded.clear()
    back_runs = read("0", now - 100, now, 100, 3 * runs)
    assert [s.ts for s in back_runs] == [s.ts for s in per[-4:]]  # the newest, one past
    assert decoded == [1, 2, 2]  # pages of 1, then 2 rows; the last past the budget
    decoded.clear()
    assert [s.ts for s in read("0", now - 100, now, 5, 10**6)] == [s.ts for s in per[-5:]]
    assert sum(decoded) == 5
