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


def test_tables_from_before_exact_request_ids_get_them_and_old_rows_read_as_before(
        store: Any, database: str) -> None:
    """A store an older kvscope made: client_requests without ``engine_ids``,
    request_events without ``requester``, the view without it. Applying the schema adds
    both columns after the others and replaces the view; rows written before read as they
    did: the comma-joined engine IDs split, the requester parsed from ``detail``."""
    from datetime import datetime, timezone

    from kvscope.explain import answer

    old = []
    for s in before_step_counters(schema.render_schema(database, 7)):  # and before 160
        if s.startswith("ALTER TABLE") and ("engine_ids" in s or "requester" in s):
            continue  # 130, 140: what this version adds
        old.append(s.replace(",  \n    requester String DEFAULT '' CODEC(ZSTD(1))", "")
                   .replace(",\n    engine_ids         Array(String) DEFAULT [] CODEC(ZSTD(1))",
                            "").replace(", server, requester\n", ", server\n")
                   .replace(", server, '' AS requester\n", ", server\n"))
    for s in old:
        store.command(s)
    assert "requester" not in columns_of(store, database, "request_events")
    assert "engine_ids" not in columns_of(store, database, "client_requests")
    t0 = 1_800_000_000.0
    ev_cols = ["ts", "model", "engine", "request_id", "event", "step", "blocks",
               "total_blocks", "free_blocks", "max_contiguous_free", "tokens", "reason",
               "detail", "server"]
    victim, requester = "cmpl-v-0-00000001", "cmpl-r-0-00000002"

    def ev(rid: str, event: str, step: int, dt: float, blocks: int = -1,
           detail: str = "") -> list[Any]:
        return [datetime.fromtimestamp(t0 + dt, tz=timezone.utc), "m", "0", rid, event, step,
                blocks, blocks, 10, -1, 0, "", detail, ""]

    store.insert(f"{database}.request_events", [
        ev(victim, "queued", 1, 0.0), ev(victim, "admitted", 2, 0.1, 4),
        ev(requester, "queued", 1, 0.0), ev(requester, "admitted", 2, 0.1, 3),
        ev(requester, "allocated", 5, 0.5, 2),
        ev(victim, "preempted", 5, 0.5, 4, f"requester={requester} blocks_needed=2"),
        ev(victim, "resumed", 7, 0.7, 4), ev(victim, "finished", 9, 0.9, -1),
        ev(requester, "finished", 8, 0.8)], column_names=ev_cols)
    cr_cols = [c for c in columns("client_requests") if c != "engine_ids"]
    row = dict.fromkeys(cr_cols, "") | {
        "ts": datetime.fromtimestamp(t0 + 1.0, tz=timezone.utc), "request_id": "ticket-1",
        "engine_request_ids": f"{victim},cmpl-gone-0-00000009", "prompt_chars": 1,
        "max_tokens": 1, "http_status": 200, "duration_s": 1.0, "duplicate": False,
        "preempt_count": 1}
    store.insert(f"{database}.client_requests", [[row[c] for c in cr_cols]],
                 column_names=cr_cols)
    schema.apply_schema(store, database, 7)
    assert columns_of(store, database, "request_events") == columns("request_events")
    assert columns_of(store, database, "client_requests") == columns("client_requests")
    got = answer.explain(store, "ticket-1")
    (api,) = got["api_requests"]
    assert api["engine_ids"] == [victim, "cmpl-gone-0-00000009"]
    assert [r["request_id"] for r in got["engine_requests"]] == [victim]
    (p,) = got["engine_requests"][0]["preemptions"]
    assert (p["requester"], p["blocks_needed"], p["trigger"]["event"]) == (
        requester, 2, "allocated")
    assert [a["request_id"] for a in answer.explain(store, victim)["api_requests"]] == [
        "ticket-1"]


def before_step_counters(statements: list[str]) -> list[str]:
    """The DDL as a kvscope from before ``step_counter`` (160) rendered it: the tables
    without the column, the view (then 150) without it, no ALTER adding it."""
    return [s.replace(",  \n    step_counter LowCardinality(String) DEFAULT ''", "")
            .replace(",\n    step_counter LowCardinality(String) DEFAULT ''", "")
            .replace(", step_counter\n", "\n")
            for s in statements if not (s.startswith("ALTER TABLE") and "step_counter" in s)]


def columns_of(store: Any, database: str, table: str) -> list[str]:
    return [c[0] for c in store.query(
        "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String} "
        "ORDER BY position", parameters={"db": database, "t": table}).result_rows]


def test_tables_from_before_step_counters_get_them_and_old_rows_read_blank(
        store: Any, database: str) -> None:
    """A store a kvscope from before ``step_counter`` made (request_events and
    request_allocations without it, the view as 150 made it): applying the schema adds the
    column to both after the others and makes the view again (170) with it; rows written
    before read '' in it, through the view too."""
    from datetime import datetime, timezone

    for s in before_step_counters(schema.render_schema(database, 7)):
        store.command(s)
    assert "step_counter" not in columns_of(store, database, "request_events")
    assert "step_counter" not in columns_of(store, database, "request_allocations")
    at = datetime.fromtimestamp(1_800_000_000.0, tz=timezone.utc)
    ev_cols = [c for c in columns("request_events") if c != "step_counter"]
    store.insert(f"{database}.request_events",
                 [[at, "m", "0", "r", "queued", 1, -1, -1, 10, -1, 0, "", "", "", ""]],
                 column_names=ev_cols)
    al_cols = [c for c in columns("request_allocations") if c != "step_counter"]
    store.insert(f"{database}.request_allocations",
                 [[at, "m", "0", "r", [2], [5], [1], [1], [9], [16], ""]],
                 column_names=al_cols)
    schema.apply_schema(store, database, 7)
    for table in ("request_events", "request_allocations"):
        assert columns_of(store, database, table) == columns(table)
    assert store.query(f"SELECT event, step, step_counter FROM {database}.request_events_all "
                       "ORDER BY step").result_rows == [("queued", 1, ""), ("allocated", 2, "")]
