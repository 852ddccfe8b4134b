"""The DDL: applies twice cleanly, matches the row dataclasses, renders a cluster variant."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvscope.rows import TABLES, columns
from kvscope.store import schema

pytestmark = pytest.mark.clickhouse


def test_schema_applies_twice_cleanly(store: Any, database: str) -> None:
    n = schema.apply_schema(store, database, ttl_days=7)
    assert schema.apply_schema(store, database, ttl_days=7) == n
    tables = {r[0]: r[1:] for r in store.query(
        "SELECT name, engine, partition_key, sorting_key, create_table_query "
        "FROM system.tables WHERE database = {db:String}", parameters={"db": database}
    ).result_rows}
    assert set(tables) == schema.table_names() | schema.view_names()
    assert schema.view_names() == {"request_events_all"}
    for name in schema.view_names():
        assert tables.pop(name)[0] == "View", name
    for name, (engine, partition, sorting, ddl) in tables.items():
        assert engine == "MergeTree", name
        assert partition == "toDate(ts)", name
        assert sorting.startswith("model, server, engine" if name != "client_requests"
                                  else "model"), name
        assert "toIntervalDay(7)" in ddl or "INTERVAL 7 DAY" in ddl, name


def test_every_row_type_has_its_columns_in_order(store: Any, database: str) -> None:
    schema.apply_schema(store, database)
    for table in sorted(schema.table_names() & set(TABLES)):
        cols = store.query(
            "SELECT name, type FROM system.columns WHERE database = {db:String} AND "
            "table = {t:String} ORDER BY position", parameters={"db": database, "t": table}
        ).result_rows
        assert [c[0] for c in cols] == columns(table), table
        types = dict(cols)
        assert types["ts"] == "DateTime64(3, 'UTC')", table
        assert types["model"] == "LowCardinality(String)", table


def test_the_sink_takes_only_tables_with_ddl() -> None:
    assert {"request_traces", "request_events", "scheduler_decisions",
            "step_stats"} <= schema.table_names()


def test_cluster_variant_is_valid_clickhouse_sql(store: Any) -> None:
    statements = schema.render_schema("kv", 30, cluster="prod")
    tables = schema.table_names()
    alters = [s for s in schema.render_schema("kv", 30) if s.startswith("ALTER TABLE")]
    settings = sum("MODIFY SETTING" in s for s in alters)  # a MergeTree setting: local only
    views = len(schema.view_names())
    assert settings == len(tables)
    assert len(statements) == (1 + 2 * len(tables) + 2 * (len(alters) - settings) + settings
                               + views)  # local, Distributed
    for stmt in statements:
        assert "ON CLUSTER 'prod'" in stmt
        assert "MODIFY SETTING" not in stmt or "_local ON CLUSTER" in stmt, stmt
        # formatQuery parses without executing: a syntax error raises here
        store.query("SELECT formatQuery({q:String})", parameters={"q": stmt})
    joined = "\n".join(statements)
    assert joined.count("ReplicatedMergeTree(") == len(tables)
    assert ("ENGINE = Distributed('prod', 'kv', 'request_traces_local', "
            "cityHash64(request_id))") in joined
    assert "'step_stats_local', cityHash64(model, server, engine))" in joined


def test_schema_command_prints_ddl(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    schema.add_parser(parser.add_subparsers(dest="command"))
    assert schema.run(parser.parse_args(["schema", "--cluster", "c1"])) == 0
    out = capsys.readouterr().out
    assert "ReplicatedMergeTree" in out and out.rstrip().endswith(";")
    assert schema.run(parser.parse_args(["schema", "--database", "bad-name"])) == 2


def test_bad_options_are_all_reported() -> None:
    with pytest.raises(ValueError, match="database .*ttl_days.*dedup_window"):
        schema.render_schema("no way", 0, dedup_window=0)


def test_statement_splitter_keeps_quoted_semicolons() -> None:
    sql = "-- a; comment\nSELECT 'a;b' ; SELECT \"x;\" -- tail;\n;"
    assert schema.split_statements(sql) == ["SELECT 'a;b'", 'SELECT "x;"']


def test_an_engine_configs_table_from_before_the_watermark_gets_it(
        store: Any, database: str) -> None:
    """A store created before kvscope recorded ``--watermark``: applying the schema adds
    the column after the others, and its older rows read 0 (none held back)."""
    old = [s for s in schema.render_schema(database, 7) if ".engine_configs\n" in s
           and s.startswith("CREATE TABLE")]
    assert len(old) == 1
    store.command(old[0].replace(",\n    watermark_blocks       Int64\n", "\n"))
    store.command(f"INSERT INTO {database}.engine_configs (ts, model, engine, session) "
                  "VALUES (now64(3), 'm', '0', 's')")
    schema.apply_schema(store, database)
    cols = store.query(
        "SELECT name FROM system.columns WHERE database = {db:String} AND "
        "table = 'engine_configs' ORDER BY position", parameters={"db": database}
    ).result_rows
    assert [c[0] for c in cols] == columns("engine_configs")
    assert store.query(f"SELECT watermark_blocks FROM {database}.engine_configs"
                       ).result_rows == [(0,)]
