"""The embedded store opens chDB with ``kvscope.store.embedded.EMBEDDED_OPTIONS`` and
inserts with its ``INSERT_SETTINGS``.

ClickHouse's memory worker re-read the process's memory 20 times a second inside the
sidecar (~2.5 ms of CPU a second with nothing to store). That test runs in a fresh
interpreter: chDB keeps one engine per process, opened with the options of its first
connection, and this process's belongs to the session's store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvscope.store.embedded import EMBEDDED_OPTIONS
from kvscope.store.sink import ClickHouseSink
from tests.clickhouse.conftest import FAST, clickhouse_connect, count
from tests.clickhouse.rowsource import trace
from tests.fresh import last_json_line

OPEN = r"""
import json, os, sys, time
import pyarrow as pa
from kvscope.store.sink import ClickHouseSink

def memory_worker_switches():
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            if f.read().strip() != "MemoryWorker":
                continue
        with open(f"/proc/self/task/{task}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    return int(line.split()[1])
    return None

pool_before = pa.default_memory_pool().backend_name
sink = ClickHouseSink("chdb://" + sys.argv[1], spool_dir=sys.argv[1] + "-spool")
pool = pa.default_memory_pool().backend_name
reader = sink.reader()
period = reader.query("SELECT value FROM system.server_settings "
                      "WHERE name = 'memory_worker_period_ms'").result_rows[0][0]
before = memory_worker_switches()
time.sleep(2.0)
woke = memory_worker_switches() - before
reader.close()
sink.close(5.0)
print(json.dumps({"period": int(period), "woke": woke, "pool_before": pool_before,
                  "pool": pool}))
"""


def test_the_embedded_store_opens_with_a_slow_memory_worker(tmp_path: Path) -> None:
    """... and the sink makes the C library's allocator pyarrow's
    (``arrow.use_system_allocator``: mimalloc gave every batch's memory back to the kernel)."""
    got = last_json_line(OPEN.replace("sys.argv[1]", repr(str(tmp_path / "chdb"))))
    assert got["pool_before"] != "system"  # pyarrow's default: mimalloc here
    assert got["pool"] == "system"
    assert got["period"] == EMBEDDED_OPTIONS["memory_worker_period_ms"] == 1000
    # chDB's default period woke it ~40 times in these 2 s; at 1 s it wakes 2-3 times
    # (it can run late on a loaded machine, never early).
    assert got["woke"] <= 6, got


class _Recorded:
    """A real chDB client whose inserts' settings are kept."""

    def __init__(self, client: Any, settings: list[dict[str, Any]]) -> None:
        self._client, self._settings = client, settings

    def raw_insert(self, *args: Any, **kwargs: Any) -> Any:
        self._settings.append(dict(kwargs.get("settings") or {}))
        return self._client.raw_insert(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_inserts_into_the_embedded_store_run_on_the_sending_thread(
        store: Any, database: str, chdb_dsn: str, tmp_path: Path) -> None:
    settings: list[dict[str, Any]] = []
    sink = ClickHouseSink(
        chdb_dsn, database=database, spool_dir=str(tmp_path / "spool"), options=FAST,
        connect=lambda: _Recorded(clickhouse_connect.get_client(dsn=chdb_dsn), settings))
    try:
        for i in range(3):
            sink.write("request_traces", trace(i))
        assert sink.flush(10.0)
    finally:
        sink.close(5.0)
    assert count(store, "request_traces") == 3
    assert len(settings) == 1
    token = settings[0].pop("insert_deduplication_token")
    assert len(token) == 32
    assert settings[0] == {"max_threads": 1, "max_insert_threads": 1}
