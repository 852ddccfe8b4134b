"""kvscope's ClickHouse tables at fleet size, on chDB (the single-node schema).

    python benchmarks/fleet_clickhouse.py [--engines 1000] [--hours 24] [--period-s 600]

One twin run (vLLM's real scheduler, the probe, the RequestTracker, the ClickHouse sink)
writes the seed rows. Each seed table is then copied for ``--engines`` engines (server,
engine, model and request IDs rewritten, two engines to a server) and tiled over
``--hours`` ending now, one copy of the run every ``--period-s`` per engine (each engine
offset in time), inside ClickHouse (INSERT ... SELECT). Reported: rows and bytes on disk
per table and per engine-day; every saved query's latency, result rows and the rows
ClickHouse plans to read (EXPLAIN ESTIMATE) against the rows it holds; and the same for a
one-server, one-hour read of every table. A report, never an assertion.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import clickhouse_connect  # noqa: E402

from kvscope.sinks.base import SinkManager  # noqa: E402
from kvscope.sinks.options import DeliveryOptions  # noqa: E402
from kvscope.store import query, schema  # noqa: E402
from kvscope.store.sink import ClickHouseSink  # noqa: E402
from tests.clickhouse.twinrun import run_twin  # noqa: E402

MODELS = "['llama-3-8b', 'llama-3-70b', 'qwen2-7b', 'mistral-7b']"
SERVER = "concat('gpu-', leftPad(toString(intDiv(e.number, 2)), 4, '0'), ':8000')"
REWRITE = {
    "server": SERVER,
    "engine": "toString(e.number % 2)",
    "model": f"arrayElement({MODELS}, intDiv(e.number, 2) % 4 + 1)",
    "request_id": "concat(request_id, '-', toString(e.number), '-', toString(c.number))",
}


def seed(dsn: str, work: Path) -> None:
    sink = ClickHouseSink(dsn, database="seed", spool_dir=str(work / "spool"),
                          options=DeliveryOptions(batch_interval_s=0.2, fsync=False))
    manager = SinkManager([sink])
    run_twin(manager.emit, n_requests=80, seed=5)
    assert sink.flush(120), "the seed rows did not reach chDB"
    manager.close()


def tables(client: Any, db: str) -> dict[str, list[tuple[str, str]]]:
    """Each stored table's columns (views, such as request_events_all, read those)."""
    rows = client.query("SELECT table, name, type FROM system.columns WHERE database = "
                        "{db:String} AND table IN (SELECT name FROM system.tables WHERE "
                        "database = {db:String} AND engine LIKE '%MergeTree') "
                        "ORDER BY table, position", parameters={"db": db}).result_rows
    out: dict[str, list[tuple[str, str]]] = {}
    for table, name, typ in rows:
        out.setdefault(table, []).append((name, typ))
    return out


def tile(client: Any, table: str, cols: list[tuple[str, str]], engines: int, copies: int,
         period_s: int, start: float) -> None:
    lo = client.query(f"SELECT toUnixTimestamp(min(ts)) FROM seed.{table}").result_rows[0][0]
    # each copy one period later; each engine offset within the period
    offset = f"e.number * 7919 % {period_s}"
    shift = f"(toInt64({int(start) - int(lo)}) + c.number * {period_s} + {offset})"
    exprs = []
    for name, typ in cols:
        if name in REWRITE:
            exprs.append(f"{REWRITE[name]} AS {name}")
        elif typ.startswith("DateTime64") and name.endswith("ts"):
            exprs.append(f"addSeconds({name}, {shift}) AS {name}")
        else:
            exprs.append(name)
    client.command(f"INSERT INTO fleet.{table} SELECT {', '.join(exprs)} FROM seed.{table}, "
                   f"numbers({engines}) AS e, numbers({copies}) AS c "
                   "SETTINGS max_insert_threads = 2")


def estimate(client: Any, sql: str, params: dict[str, Any]) -> int:
    rows = client.query("EXPLAIN ESTIMATE " + sql, parameters=params).result_rows
    return int(sum(r[3] for r in rows))  # database, table, parts, rows, marks


def saved_queries(client: Any, totals: dict[str, int]) -> dict[str, Any]:
    out = {}
    for f in schema.sql_files("queries"):
        q = query.SavedQuery.load(f.name[:-4])
        given = {k: "1" if "Int" in t else "" for k, t in q.types.items() if k not in q.defaults}
        params = q.bind(given)
        t0 = time.perf_counter()
        rows = client.query(q.sql, parameters=params).result_rows
        wall = time.perf_counter() - t0
        out[q.name] = {"wall_s": round(wall, 3), "result_rows": len(rows),
                       "rows_to_read": estimate(client, q.sql, params)}
    out["_table_rows"] = totals
    return out


def one_server_hour(client: Any, names: list[str], end: float, engines: int) -> dict[str, Any]:
    """``WHERE server = s AND ts in the last hour``, and with the engine too."""
    out = {}
    server = f"gpu-{min(7, engines // 2 - 1):04d}:8000"
    for t in names:
        for key, extra in (("server", ""), ("server+engine", " AND engine = '1'")):
            sql = (f"SELECT count() FROM fleet.{t} WHERE server = '{server}'{extra} AND "
                   f"ts >= toDateTime64({int(end) - 3600}, 3) AND ts < toDateTime64({int(end)}, 3)")
            t0 = time.perf_counter()
            n = client.query(sql).result_rows[0][0]
            out[f"{t} {key}"] = {"wall_s": round(time.perf_counter() - t0, 3), "rows": n,
                                 "rows_to_read": estimate(client, sql, {})}
    return out


def sizes(client: Any, engines: int, hours: float) -> dict[str, Any]:
    rows = client.query("SELECT table, sum(rows), sum(bytes_on_disk), count() FROM "
                        "system.parts WHERE database = 'fleet' AND active GROUP BY table "
                        "ORDER BY table").result_rows
    days = engines * hours / 24
    return {t: {"rows": r, "bytes": b, "parts": p, "rows_per_engine_day": round(r / days),
                "bytes_per_engine_day": round(b / days)} for t, r, b, p in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--period-s", type=int, default=600)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvscope-fleet-ch-") as tmp:
        work = Path(tmp)
        dsn = f"chdb://{work / 'chdb'}"
        t0 = time.monotonic()
        seed(dsn, work)
        client = clickhouse_connect.get_client(dsn=dsn)
        schema.apply_schema(client, "fleet")
        end = time.time()
        copies = int(args.hours * 3600 // args.period_s)
        seeded = tables(client, "seed")
        seed_rows = {t: client.query(f"SELECT count() FROM seed.{t}").result_rows[0][0]
                     for t in seeded}
        filled = [t for t, n in seed_rows.items() if n]
        t1 = time.monotonic()
        for t in filled:
            tile(client, t, seeded[t], args.engines, copies, args.period_s,
                 end - args.hours * 3600)
        report: dict[str, Any] = {
            "engines": args.engines, "hours": args.hours, "period_s": args.period_s,
            "seed_rows": seed_rows, "seed_s": round(t1 - t0, 1),
            "insert_s": round(time.monotonic() - t1, 1),
            "sizes": sizes(client, args.engines, args.hours)}
        totals = {t: v["rows"] for t, v in report["sizes"].items()}
        report["saved"] = saved_queries(
            clickhouse_connect.get_client(dsn=dsn, database="fleet"), totals)
        report["one_server_hour"] = one_server_hour(client, filled, end, args.engines)
        client.close()
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
