"""What a stopped sidecar left behind: its embedded store, its spool, its decision log.

The store is read in a process of its own (chDB: one process per directory, and the test
process may hold another):

python -m tests.reliability.stores CHDB_DIR [NEEDLE ...]

prints one JSON object: per stored table (not view) of the kvscope database its row
count, its distinct request IDs (when it has the column) and its duplicate rows; and per
needle, every (table, column, rows) whose value, as text, contains it. Every column of
every table is searched, whatever its type.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import clickhouse_connect

from kvscope.sinks.spool import SpooledBatch
from kvscope.store.schema import DEFAULT_DATABASE


def _q(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def read(chdb_dir: str, needles: list[str]) -> dict[str, Any]:
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    db = DEFAULT_DATABASE
    out: dict[str, Any] = {"tables": {}, "hits": {n: [] for n in needles}}
    tables = [r[0] for r in client.query(
        f"SELECT name FROM system.tables WHERE database = {_q(db)} AND engine != 'View' "
        "ORDER BY name").result_rows]  # a view's rows are its tables' rows again
    for table in tables:
        cols = [r[0] for r in client.query(
            f"SELECT name FROM system.columns WHERE database = {_q(db)} AND table = {_q(table)}"
            " ORDER BY position").result_rows]
        full = f"{db}.{table}"
        info: dict[str, Any] = {"rows": int(client.command(f"SELECT count() FROM {full}"))}
        if "request_id" in cols:
            info["distinct_request_ids"] = int(client.command(
                f"SELECT uniqExact(request_id) FROM {full}"))
        every = ", ".join(f"`{c}`" for c in cols)
        info["duplicate_rows"] = int(client.command(
            f"SELECT count() - uniqExact(tuple({every})) FROM {full}"))
        out["tables"][table] = info
        for needle in needles:
            for col in cols:
                n = int(client.command(
                    f"SELECT countIf(position(toString(`{col}`), {_q(needle)}) > 0) "
                    f"FROM {full}"))
                if n:
                    out["hits"][needle].append([table, col, n])
    client.close()
    return out


def read_store(chdb_dir: str, needles: list[str] | None = None,
               timeout_s: float = 120.0) -> dict[str, Any]:
    """Run this module as a child and return what it printed."""
    from tests.reliability.serveproc import ROOT, clean_env

    proc = subprocess.run([sys.executable, "-m", "tests.reliability.stores", chdb_dir,
                           *(needles or [])], capture_output=True, text=True, cwd=ROOT,
                          env=clean_env(PYTHONPATH=str(ROOT)), timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def spool_rows(spool_dir: Path) -> Counter[str]:
    """Rows waiting in a spool directory, by table (from the batch file names)."""
    out: Counter[str] = Counter()
    if spool_dir.is_dir():
        for name in os.listdir(spool_dir):
            b = SpooledBatch.parse(name, 0)
            if b is not None:
                out[b.table] += b.rows
    return out


def decision_events(path: Path) -> Counter[str]:
    """Lines of a decision log (and its rotations), by event."""
    out: Counter[str] = Counter()
    for p in sorted(path.parent.glob(path.name + "*")):
        for line in p.read_text().splitlines():
            out[json.loads(line)["event"]] += 1
    return out


if __name__ == "__main__":
    print(json.dumps(read(sys.argv[1], sys.argv[2:])))
