"""The dedup window: a batch sent again with its token is stored once, even after as many
other inserts into its table as a fleet makes while that batch waits to be re-sent (the
arithmetic: clickhouse/README.md, "Dedup window")."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvscope.store import arrow, schema
from kvscope.store.sink import ClickHouseSink
from tests.clickhouse.conftest import FAST, count
from tests.clickhouse.rowsource import trace

pytestmark = pytest.mark.clickhouse

OTHER_INSERTS = 1_200
"""Inserts other sidecars make into the table between a batch's first send and its
re-send: more than the 1,000 blocks the window held before 120_dedup_window.sql."""


def send(store: Any, database: str, rows: list[Any], token: str) -> None:
    """One batch into request_traces as the sink sends it: Arrow, with its own token."""
    payload = arrow.encode("request_traces", rows)
    store.raw_insert(f"{database}.request_traces", arrow.column_names(payload), payload,
                     settings={"insert_deduplication_token": token}, fmt="Arrow")


def test_a_batch_resent_after_a_fleets_inserts_is_stored_once(store: Any,
                                                                database: str) -> None:
    """A sidecar's answer was lost (or it died before deleting the batch from its spool);
    meanwhile the rest of the fleet inserted into the same table; the batch comes again
    with its token and must not be counted twice."""
    schema.apply_schema(store, database)
    batch = [trace(i) for i in range(100)]
    send(store, database, batch, "lost-answer")
    for i in range(OTHER_INSERTS):
        send(store, database, [trace(1_000 + i)], f"other-sidecar-{i}")
    send(store, database, batch, "lost-answer")
    assert count(store, f"{database}.request_traces", "prompt_len < 100") == 100
    assert count(store, f"{database}.request_traces") == 100 + OTHER_INSERTS


def window(store: Any, database: str) -> dict[str, int]:
    """Each table's non_replicated_deduplication_window, as its CREATE statement reads."""
    rows = store.query("SELECT name, create_table_query FROM system.tables "
                       "WHERE database = {db:String} AND engine = 'MergeTree'",
                       parameters={"db": database}).result_rows
    found = {name: re.search(r"non_replicated_deduplication_window = (\d+)", ddl)
             for name, ddl in rows}
    return {name: int(m[1]) if m else 0 for name, m in found.items()}


def test_tables_from_before_get_the_fleet_window(store: Any, database: str) -> None:
    """A store whose tables an older kvscope created with a window of 1,000: the DDL's
    next apply (a sidecar's start) widens every table's window, and their rows stay."""
    for stmt in schema.render_schema(database, 7, dedup_window=1_000):
        if not stmt.startswith("ALTER TABLE"):  # as the older DDL made them
            store.command(stmt)
    assert window(store, database) == dict.fromkeys(schema.table_names(), 1_000)
    send(store, database, [trace(i) for i in range(10)], "before-the-upgrade")
    schema.apply_schema(store, database)
    assert window(store, database) == dict.fromkeys(schema.table_names(), schema.DEDUP_WINDOW)
    assert count(store, f"{database}.request_traces") == 10


def test_the_embedded_store_keeps_a_small_window(chdb_dsn: str, database: str,
                                                 tmp_path: Path) -> None:
    """One sidecar alone writes the embedded store: its tables keep the small window, and
    the memory a fleet's window costs stays out of the sidecar."""
    sink = ClickHouseSink(chdb_dsn, database=database, options=FAST,
                          spool_dir=str(tmp_path / "spool"))
    try:
        client = sink.client()
        assert window(client, database) == dict.fromkeys(schema.table_names(),
                                                         schema.EMBEDDED_DEDUP_WINDOW)
    finally:
        assert sink.close(5)
