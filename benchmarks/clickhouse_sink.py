"""ClickHouse sink throughput into chDB, insert paths side by side, and the hourly query
over 10 million rows.

    python benchmarks/clickhouse_sink.py [--rows 500000] [--query-rows 10000000] [--json]

1. sink: RequestTrace objects through ``ClickHouseSink.write`` (the receiver thread's
   call) until ``flush()`` reports them in the store: rows per wall second and per CPU
   second of the whole process (all threads: "per core"), with fsync on as in production.
2. paths: the same 200k rows into chDB through clickhouse-connect four ways, from row
   objects: Arrow IPC bytes + ``raw_insert(fmt="Arrow")`` (the sink's path, one code path
   for server and chDB), ``insert_arrow(pa.Table)``, ``insert(rows)`` (Native), and
   ``INSERT ... SELECT * FROM Python(tbl)`` (chDB only, through ``client.command``).
3. query: ``hourly_preemptions`` over ``--query-rows`` synthetic traces (plus a fifth as
   many preemption decisions) spread over the last 7 days; median of 5 warm runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

from _common import machine_noise

from kvscope.rows import RequestTrace, columns
from kvscope.sinks.options import DeliveryOptions
from kvscope.store import arrow, query
from kvscope.store.sink import ClickHouseSink


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def traces(n: int) -> list[RequestTrace]:
    now = time.time()
    return [RequestTrace(
        ts=now - (n - i) * 1e-4, model="llama-3-8b", engine="0", request_id=f"cmpl-{i:012x}",
        prompt_len=100 + i % 3000, max_gen_len=512, output_len=i % 512, required_blocks=i % 97,
        allocated_blocks=i % 101, contiguous_allocated=i % 2 == 0, block_fragments=1 + i % 5,
        preempt_count=i % 4, preempt_reason="kv_full" if i % 4 else "",
        recomputed_tokens=i % 700, cached_tokens=i % 64, free_blocks_at_alloc=i % 300,
        max_contiguous_free_blocks_at_alloc=i % 40,
        arrival_ts=now - (n - i) * 1e-4 - 2.5, queue_seconds=0.25, first_token_seconds=0.5,
        e2e_seconds=2.5, finish_reason="FINISHED_STOPPED", client_id=f"c{i % 50}",
        user_agent="openai-python/1.40", api_key_hash="ab12", prompt_hash=f"{i * 7919:016x}")
        for i in range(n)]


def bench_sink(dsn: str, rows: list[RequestTrace], spool: str) -> dict[str, Any]:
    # The whole burst may wait in memory: this measures sustained delivery, not the
    # memory bound (a tracker emits far slower than this loop writes).
    sink = ClickHouseSink(dsn, database="bench_sink", spool_dir=spool,
                          options=DeliveryOptions(batch_rows=20_000, max_queue_rows=len(rows)))
    assert sink.flush(60)  # connect and apply the DDL before timing
    c0, t0 = cpu_s(), time.perf_counter()
    for r in rows:
        sink.write("request_traces", r)
    t_write = time.perf_counter() - t0
    assert sink.flush(600)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    stored = int(sink.client().command("SELECT count() FROM bench_sink.request_traces"))
    st = sink.stats()
    sink.close(10)
    assert stored == len(rows) and not any(st.rows_dropped.values()), (stored, st)
    return {"rows": len(rows), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "rows_per_s": round(len(rows) / wall), "rows_per_cpu_s": round(len(rows) / cpu),
            "write_call_us": round(t_write / len(rows) * 1e6, 3)}


def bench_paths(client: Any, rows: list[RequestTrace], rounds: int = 3) -> dict[str, Any]:
    """Each path ``rounds`` times, interleaved; medians of rows per wall / CPU second."""
    names = columns("request_traces")
    import pyarrow as pa

    def raw_arrow() -> None:  # the sink's path
        payload = arrow.encode("request_traces", rows)
        client.raw_insert("bench_paths.request_traces", arrow.column_names(payload),
                          payload, fmt="Arrow", settings={"insert_deduplication_token": tok})

    def insert_arrow() -> None:
        tbl = pa.Table.from_batches([arrow.to_record_batch("request_traces", rows)])
        client.insert_arrow("request_traces", tbl, database="bench_paths",
                            settings={"insert_deduplication_token": tok})

    def insert_native() -> None:
        from datetime import datetime, timezone

        data = [[datetime.fromtimestamp(v, timezone.utc) if arrow.is_time(k) else v
                 for k, v in zip(names, (getattr(r, k) for k in names), strict=True)]
                for r in rows]
        client.insert("request_traces", data, column_names=names, database="bench_paths",
                      settings={"insert_deduplication_token": tok})

    def python_table() -> None:  # chDB only: the engine reads the local variable ``tbl``
        tbl = pa.Table.from_batches([arrow.to_record_batch("request_traces", rows)])
        assert tbl.num_rows
        client.command("INSERT INTO bench_paths.request_traces SETTINGS "
                       f"insert_deduplication_token = '{tok}' SELECT * FROM Python(tbl)")

    paths = {"raw_insert_arrow (sink)": raw_arrow, "insert_arrow": insert_arrow,
             "insert_native": insert_native, "chdb_python_table": python_table}
    wall: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, list[float]] = {k: [] for k in paths}
    for r in range(rounds):
        for label, fn in paths.items():
            client.command("TRUNCATE TABLE bench_paths.request_traces")
            tok = f"{label}-{r}"
            c0, t0 = cpu_s(), time.perf_counter()
            fn()
            wall[label].append(time.perf_counter() - t0)
            cpu[label].append(cpu_s() - c0)
            n = int(client.command("SELECT count() FROM bench_paths.request_traces"))
            assert n == len(rows), (label, n)
    t0 = time.perf_counter()
    arrow.encode("request_traces", rows)
    out: dict[str, Any] = {"rows": len(rows),
                           "encode_only_rows_per_s": round(len(rows) / (time.perf_counter() - t0))}
    for label in paths:
        out[label] = {"rows_per_s": round(len(rows) / statistics.median(wall[label])),
                      "rows_per_cpu_s": round(len(rows) / statistics.median(cpu[label]))}
    return out


SYNTH_TRACES = """
INSERT INTO bench_q.request_traces
SELECT now64(3) - toIntervalMillisecond(number * {span:UInt64} DIV {n:UInt64}) AS ts,
       'model-' || toString(number % 3), toString(number % 4), 'cmpl-' || hex(number),
       100 + number % 3000, 512, number % 512, 1 + number % 97, 1 + number % 101,
       number % 2 = 0, 1 + number % 5, if(number % 10 = 0, 1 + number % 3, 0),
       if(number % 10 = 0, 'kv_full', ''), number % 700, 0, number % 300, number % 40,
       ts - toIntervalSecond(3), 0.25, 0.5, 3.0, 'FINISHED_STOPPED', '', '', '', ''
FROM numbers({n:UInt64})
"""
SYNTH_PREEMPTS = """
INSERT INTO bench_q.scheduler_decisions
SELECT now64(3) - toIntervalMillisecond(number * {span:UInt64} DIV {n:UInt64}),
       'model-' || toString(number % 3), toString(number % 4), 'preempt',
       'cmpl-' || hex(number), 'kv_full', 1 + number % 17, number % 16, number % 9,
       number % 700, 'fcfs', 'Preempting request'
FROM numbers({n:UInt64})
"""


def bench_query(client: Any, n: int) -> dict[str, Any]:
    span = 7 * 86_400_000 - 60_000
    t0 = time.perf_counter()
    client.command(SYNTH_TRACES, parameters={"n": n, "span": span})
    client.command(SYNTH_PREEMPTS, parameters={"n": n // 5, "span": span})
    load = time.perf_counter() - t0
    q = query.SavedQuery.load("hourly_preemptions")
    client.command("OPTIMIZE TABLE request_traces FINAL")  # settle merges before timing
    times, cpus, result = [], [], []
    for _ in range(6):
        c0, t = cpu_s(), time.perf_counter()
        result = client.query(q.sql, parameters=q.bind({})).result_rows
        times.append(time.perf_counter() - t)
        cpus.append(cpu_s() - c0)
    return {"trace_rows": n, "preempt_rows": n // 5, "load_s": round(load, 2),
            "hours": len(result), "first_s": round(times[0], 3),
            "median_s": round(statistics.median(times[1:]), 3),
            "min_s": round(min(times[1:]), 3),
            "median_cpu_s": round(statistics.median(cpus[1:]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--path-rows", type=int, default=200_000)
    ap.add_argument("--query-rows", type=int, default=10_000_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import clickhouse_connect

    from kvscope.store import schema

    tmp = tempfile.mkdtemp(prefix="kvscope-bench-ch-")
    dsn = f"chdb://{tmp}/store"
    try:
        report: dict[str, Any] = {"machine": machine_noise(), "cpus": os.cpu_count()}
        rows = traces(args.rows)
        report["sink"] = bench_sink(dsn, rows, f"{tmp}/spool")
        client = clickhouse_connect.get_client(dsn=dsn)
        schema.apply_schema(client, "bench_paths")
        client.command("DROP DATABASE bench_sink SYNC")  # no merges of it during the rest
        report["paths"] = bench_paths(client, rows[: args.path_rows])
        schema.apply_schema(client, "bench_q")
        q_client = clickhouse_connect.get_client(dsn=dsn, database="bench_q")
        report["hourly_query"] = bench_query(q_client, args.query_rows)
        q_client.close()
        client.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(report, indent=1 if not args.json else None))


if __name__ == "__main__":
    main()
