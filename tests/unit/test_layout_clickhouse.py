"""The layout table on chDB: the DDL applies (twice), layout_rows insert and read back, and
the heatmap query answers block x time exactly.

chDB allows one data directory per process, and other suites open their own: the check
runs in a child process (``python -m tests.unit.test_layout_clickhouse DIR``) that
prints what it found as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DB = "kvscope_layout_test"


def check(data_dir: str) -> dict[str, Any]:
    import clickhouse_connect

    from kvscope.layout.history import layout_rows
    from kvscope.layout.sampler import LayoutSampler
    from kvscope.store import schema
    from kvscope_probe import wire
    from tests.unit.test_hub import feed
    from tests.unit.test_layout import C, F, N, U, pool
    from tests.unit.test_wire import step

    admin = clickhouse_connect.get_client(dsn=f"chdb://{data_dir}")
    admin.command(f"CREATE DATABASE IF NOT EXISTS {DB}")
    ddl = (ROOT / "clickhouse/schema/050_layout_snapshots.sql").read_text()
    for _ in range(2):  # idempotent
        admin.command(ddl.format(database=DB, ttl_days=7,
                                 dedup_window=schema.EMBEDDED_DEDUP_WINDOW))
    client = clickhouse_connect.get_client(dsn=f"chdb://{data_dir}", database=DB)

    hub = pool([N, U, U, F, U, C, C, F], {"a": [[1, 2]], "b": [[4, 1]]}, {"a": 20, "b": 9})
    sampler = LayoutSampler(hub)
    t0 = float(int(time.time() - 120) // 60 * 60 + 10)  # recent (TTL); both in one minute
    snaps = sampler.tick(now=t0)
    feed(hub, [step(ops=[(wire.OP_ALLOC, [3, 7])], free_blocks=2)], 3)
    snaps += sampler.tick(now=t0 + 1)
    rows = [r for s in snaps for r in layout_rows(s)]
    as_dt = [{**r, "ts": datetime.fromtimestamp(r["ts"], tz=timezone.utc)} for r in rows]
    client.insert("layout_snapshots", [list(r.values()) for r in as_dt],
                  column_names=list(rows[0]))

    back = client.query("SELECT states, owner, owner_req_ids, owner_blocks, owner_fragments, "
                        "block_group, budget_utilization FROM layout_snapshots ORDER BY ts")
    sql = (ROOT / "clickhouse/queries/layout_heatmap.sql").read_text()
    params = {"engine": "0", "server": "", "model": "", "since": t0 - 1, "until": t0 + 5,
              "time_bucket_s": 1, "block_bucket": 1, "kv_group": -1}
    cells = client.query(sql, parameters=params).result_rows
    coarse = client.query(sql, parameters={**params, "block_bucket": 4,
                                           "time_bucket_s": 60}).result_rows
    pairs = client.query(sql, parameters={**params, "block_bucket": 2,
                                          "time_bucket_s": 60}).result_rows
    # a --param given as text is UTC, in a store whose time zone is not (it was read in
    # the session's zone: nine hours off in Tokyo)
    utc_text = {k: datetime.fromtimestamp(params[k], tz=timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S.%f")[:-3] for k in ("since", "until")}
    tokyo = client.query(sql, parameters={**params, **utc_text},
                         settings={"session_timezone": "Asia/Tokyo"}).result_rows
    other = client.query(sql, parameters={**params, "engine": "9"}).result_rows
    group1 = client.query(sql, parameters={**params, "kv_group": 1}).result_rows
    # engine 0 of a second server in the same range: its pool is not mixed into this one's
    client.insert("layout_snapshots", [list({**r, "server": "b"}.values()) for r in as_dt],
                  column_names=list(rows[0]))
    try:
        client.query(sql, parameters=params)
        mixed = "answered"
    except Exception as exc:  # noqa: BLE001 - the store's refusal, read below
        mixed = str(exc)
    server_b = client.query(sql, parameters={**params, "server": "b"}).result_rows
    return {
        "written": [[r[k] for k in ("states", "owner", "owner_req_ids", "owner_blocks",
                                    "owner_fragments", "block_group")] for r in rows],
        "read": [list(r[:6]) for r in back.result_rows],
        "utilization": [r[6] for r in back.result_rows],
        "cells": [[c[0].timestamp() if hasattr(c[0], "timestamp") else c[0], c[1], c[2]]
                  for c in cells],
        "coarse": [[c[1], c[2]] for c in coarse],
        "pairs": [[c[1], c[2]] for c in pairs],
        "tokyo_same": tokyo == cells and len(cells) > 0,
        "mixed_refused": "give --param server=" in mixed,
        "one_server_same": server_b == cells and rows[0]["server"] != "b",
        "other": len(other),
        "group1": len(group1),
        "t0": t0,
    }


def test_layout_rows_and_the_heatmap_query_on_chdb(tmp_path: Path) -> None:
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tests.unit.test_layout_clickhouse",
                        str(tmp_path / "chdb")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["read"] == got["written"]
    first, second = got["written"]
    assert first[:3] == [[3, 2, 2, 0, 2, 1, 1, 0], [0, 1, 1, 0, 2, 0, 0, 0], ["a", "b"]]
    assert second[0] == [3, 2, 2, 2, 2, 1, 1, 2]
    assert all(u == -1.0 or u >= 0 for u in got["utilization"])

    t0 = got["t0"]
    by_time: dict[float, list[int]] = {}
    for ts, block, state in got["cells"]:
        by_time.setdefault(round(ts - t0), [None] * 8)[block] = state
    assert by_time == {0: first[0], 1: second[0]}
    # one minute, cells of 4 blocks: the state most samples of each cell had
    assert got["coarse"] == [[0, 2], [4, 1]]
    # cells of 2 blocks: blocks 0-1 were null twice and allocated twice, 4-5 allocated
    # twice and cached twice; a tie goes to the higher state, in every run
    assert got["pairs"] == [[0, 3], [2, 2], [4, 2], [6, 1]]
    assert got["tokyo_same"] is True
    assert got["mixed_refused"] is True and got["one_server_same"] is True
    assert got["other"] == 0 and got["group1"] == 0  # one KV group: group 1 holds nothing
    print(f"chDB layout check: {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1]), default=str))
