"""Disk per engine-day of every ClickHouse table, from a live sidecar's own store.

    python benchmarks/store_disk.py [--pool 32768] [--running 256] [--steps 20000]
        [--idle-s 60] [--out DIR]

A real ``kvscope serve`` (the embedded chDB store in its data dir, the default layout
interval) fed by one ``decode_feed.py`` engine (vLLM's real scheduler with no model, the
probe loaded as vLLM loads plugins, ``--running`` busy seats in a ``--pool``-block pool) for
``--steps`` steps, then ``--idle-s`` seconds of the same engine connected and idle (an idle
night: no step, the pool unchanged). The sidecar is stopped, its store opened, and each
phase's rows of each table copied into a table of the same definition, merged (OPTIMIZE
FINAL: what the store's background merges reach) and read from ``system.parts``. Reported
per table: rows per second and bytes per row in each phase, and bytes per engine-day busy
and idle (a day at that phase's rate). A report, never an assertion: a table and one JSON
line (also ``summary.json``).

The client_requests table is written only for requests through the API server's middleware;
this feed has none.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import git_state, wait_engine_steps
from sidecar_live import start_sidecar

from kvscope.procs import stop_process

HERE = Path(__file__).resolve().parent
DAY = 86_400


def start_engine(args: argparse.Namespace, endpoint: str) -> subprocess.Popen[str]:
    argv = [sys.executable, str(HERE / "decode_feed.py"), "--running", str(args.running),
            "--pool", str(args.pool), "--warm", "0", "--steps", str(args.steps),
            "--interval", str(args.interval), "--probe", endpoint, "--engine", "disk-e0",
            "--wait", "--hold-s", str(args.idle_s + 30)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdin is not None
    if (line := proc.stdout.readline()).strip() != "READY":
        raise RuntimeError(f"engine did not start: {line!r}")
    return proc


def measure(chdb_dir: Path, phases: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Per table and phase (wall-clock [from, to)): the phase's rows copied into a table
    of the same definition, merged (OPTIMIZE FINAL: what background merges reach), and
    read from system.parts: rows, bytes on disk, uncompressed bytes."""
    import clickhouse_connect

    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    out: dict[str, Any] = {}
    try:
        tables = [r[0] for r in client.query(
            "SELECT name FROM system.tables WHERE database = 'kvscope' AND "
            "engine LIKE '%MergeTree'").result_rows]
        client.command("CREATE DATABASE IF NOT EXISTS disk")
        for name, (t0, t1) in phases.items():
            for t in tables:
                copy = f"disk.{t}_{name}"
                client.command(f"CREATE TABLE {copy} AS kvscope.{t}")
                client.command(f"INSERT INTO {copy} SELECT * FROM kvscope.{t} WHERE "
                               f"toUnixTimestamp64Milli(ts) >= {int(t0 * 1000)} AND "
                               f"toUnixTimestamp64Milli(ts) < {int(t1 * 1000)}")
                client.command(f"OPTIMIZE TABLE {copy} FINAL")
                n, size, raw = client.query(
                    "SELECT sum(rows), sum(bytes_on_disk), sum(data_uncompressed_bytes) FROM "
                    "system.parts WHERE database = 'disk' AND table = {t:String} AND active",
                    parameters={"t": f"{t}_{name}"}).result_rows[0]
                n, size = int(n or 0), int(size or 0)
                out.setdefault(name, {})[t] = {
                    "rows": n, "rows_per_s": n / (t1 - t0), "bytes": size,
                    "raw_bytes": int(raw or 0), "bytes_per_row": size / n if n else 0.0,
                    "mb_per_engine_day": size / (t1 - t0) * DAY / 1e6}
    finally:
        client.close()
    return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    (work / "run").mkdir(parents=True)
    endpoint = f"ipc://{work}/run/probe.sock"
    side = start_sidecar(endpoint, work, "on", None)
    engine = None
    try:
        engine = start_engine(args, endpoint)
        time.sleep(2.0)  # the hello and first keyframe in
        t0 = time.time()
        engine.stdin.write("\n")
        engine.stdin.flush()
        result = json.loads(engine.stdout.readline())
        wait_engine_steps(side.url, "disk-e0", result["steps"], 120)
        t1 = time.time()
        time.sleep(args.idle_s)
        t2 = time.time()
    finally:
        side.stop()
        if engine is not None:
            stop_process(engine, 10, group=True)
    phases = {"busy": (t0, t1), "idle": (t1 + 2.0, t2)}  # 2 s: the last busy sample
    return {"git": git_state(), "pool": args.pool, "running": args.running,
            "steps": result["steps"], "preemptions": result["preemptions"],
            "running_mean": result["running_mean"], "interval": args.interval,
            "busy_s": t1 - t0, "idle_s": t2 - t1 - 2.0,
            **measure(work / "data" / "chdb", phases)}


def report(s: dict[str, Any]) -> None:
    print(f"{s['pool']} blocks, {s['running_mean']:.0f} running: {s['steps']} steps in "
          f"{s['busy_s']:.0f} s ({s['preemptions']} preemptions), then {s['idle_s']:.0f} s "
          "idle")
    print(f"{'table':24} {'busy rows/s':>11} {'B/row':>8} {'MB/engine-day':>13} "
          f"{'idle rows/s':>11} {'B/row':>8} {'MB/engine-day':>13}")
    for t in sorted(s["busy"]):
        b, i = s["busy"][t], s["idle"][t]
        print(f"{t:24} {b['rows_per_s']:11.2f} {b['bytes_per_row']:8.0f} "
              f"{b['mb_per_engine_day']:13.2f} {i['rows_per_s']:11.2f} "
              f"{i['bytes_per_row']:8.0f} {i['mb_per_engine_day']:13.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pool", type=int, default=32768)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--idle-s", type=float, default=60.0)
    p.add_argument("--interval", type=float, default=0.0, help="seconds between steps")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvscope-disk-"))
    summary = run(args, work)
    report(summary)
    line = json.dumps(summary)
    print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(line)


if __name__ == "__main__":
    main()
