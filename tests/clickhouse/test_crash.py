"""kill -9 of a process writing through the sink loses no acknowledged row and, after
recovery, duplicates none. Each writer and its recovery run in processes of their own on a
chDB directory of their own (chDB: one process per directory)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.clickhouse
ROOT = Path(__file__).resolve().parents[2]


def writer(mode: str, tmp: Path, *extra: str, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.clickhouse.crashwriter", mode, str(tmp / "store"),
         str(tmp / "spool"), *extra], cwd=ROOT, env=env, text=True, **kw)


def recover(tmp: Path, acked: int = 0) -> dict[str, Any]:
    proc = writer("recover", tmp, str(acked), stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return json.loads(out.strip().splitlines()[-1])


def test_killed_between_insert_and_spool_delete(tmp_path: Path) -> None:
    proc = writer("die-after-insert", tmp_path)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    left = sorted(p.name for p in (tmp_path / "spool").glob("*.batch"))
    assert [n.split(".")[0] for n in left] == ["000000000002", "000000000003"]
    got = recover(tmp_path, 3000)
    assert got["delivered"]
    assert got["count"] == got["distinct"] == got["below"] == 3000  # batch 2 not doubled
    assert got["stats"]["request_traces"] == 2000  # batches 2 and 3 sent again


@pytest.mark.parametrize("seed", [1, 2])
def test_random_kill_during_flushes(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    proc = writer("stream", tmp_path, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    acked = 0
    deadline = time.monotonic() + 120
    while acked < 1500 + 500 * rng.randrange(4) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "the writer died on its own"
        acked = int(line.split()[1])
    time.sleep(rng.uniform(0.0, 0.15))
    proc.send_signal(signal.SIGKILL)
    for line in proc.stdout:  # acks printed before the kill landed
        acked = int(line.split()[1])
    assert proc.wait(timeout=30) == -signal.SIGKILL
    got = recover(tmp_path, acked)
    assert got["below"] == acked  # no acknowledged row lost
    assert got["count"] == got["distinct"] >= acked  # none duplicated
