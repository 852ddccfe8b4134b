"""At fleet size, one server's hour is a narrow read: the sorting keys of the per-engine
tables lead with the engine's identity (model, server, engine), so ClickHouse's primary
index skips every other server's rows. Checked on chDB with the real DDL: 64 servers of
two engines each, four hours of rows ending now (older rows would be past the TTL), and
``EXPLAIN ESTIMATE`` (the rows ClickHouse plans to read after index analysis) of one
server's hour, given with its model as the dashboards' variables give it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvscope.store import schema

pytestmark = pytest.mark.clickhouse

SERVERS = 64
HOURS = 4
EVERY_S = 2
"""One row per engine every 2 s: ~920,000 rows a table, a few seconds of chDB."""
START = (int(time.time()) // 3600 - HOURS) * 3600
TABLES = ("request_traces", "request_events", "scheduler_decisions", "step_stats")


def fill(store: Any, database: str, table: str) -> int:
    per_engine = HOURS * 3600 // EVERY_S
    n = SERVERS * 2 * per_engine
    # step_stats is the one table without request IDs
    rid = ", request_id" if table != "step_stats" else ""
    rid_value = ", concat('r', toString(number))" if rid else ""
    engines = SERVERS * 2
    store.command(
        f"INSERT INTO {database}.{table} (ts, model, engine, server{rid}) "
        f"SELECT toDateTime64({START} + intDiv(number, {engines}) * {EVERY_S}, 3), "
        f"['a', 'b', 'c', 'd'][intDiv(number % {engines}, 2) % 4 + 1], toString(number % 2), "
        f"concat('gpu-', toString(intDiv(number % {engines}, 2)), ':8000'){rid_value} "
        f"FROM numbers({n})")
    return n


def planned_rows(store: Any, sql: str) -> int:
    return int(sum(r[3] for r in store.query("EXPLAIN ESTIMATE " + sql).result_rows))


def test_one_server_one_hour_reads_a_small_fraction(store: Any, database: str) -> None:
    schema.apply_schema(store, database)
    hour = f"toDateTime64({START + 3600}, 3) AND ts < toDateTime64({START + 7200}, 3)"
    read = {}
    for table in TABLES:
        total = fill(store, database, table)
        sql = (f"SELECT ts, engine FROM {database}.{table} WHERE model = 'd' AND "
               f"server = 'gpu-7:8000' AND ts >= {hour}")
        assert len(store.query(sql).result_rows) == 2 * 3600 // EVERY_S
        read[table] = planned_rows(store, sql) / total
    print(f"\none server, one hour of {SERVERS} servers x {HOURS} h: share of rows read "
          + ", ".join(f"{t} {f:.2%}" for t, f in read.items()))
    # A server's hour is 1/256 of each table; index granules (8192 rows) round it up.
    assert all(f <= 1 / 20 for f in read.values()), read


def test_the_default_sharding_key_spreads_a_fleet_over_its_shards(store: Any) -> None:
    """Tables without a per-request key shard by engine identity: 1,000 engines (500
    servers of two engines, four models) over 8 shards must fill every shard evenly,
    which the vLLM engine label alone ("0", "1") cannot."""
    key = schema.DEFAULT_SHARDING_KEY
    rows = store.query(
        f"SELECT {key} % 8 AS shard, count() FROM (SELECT "
        "['a', 'b', 'c', 'd'][intDiv(number, 2) % 4 + 1] AS model, "
        "concat('gpu-', toString(intDiv(number, 2)), ':8000') AS server, "
        "toString(number % 2) AS engine FROM numbers(1000)) GROUP BY shard").result_rows
    per_shard = sorted(n for _, n in rows)
    print(f"\nengines per shard under {key}: {per_shard}")
    assert len(per_shard) == 8 and max(per_shard) <= 1.5 * 1000 / 8, per_shard
