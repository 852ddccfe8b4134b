"""Connecting to the store, and how the embedded one (chDB, ``chdb:///path``) is opened.

chDB runs ClickHouse's background threads inside the sidecar, with a server's defaults for
a server's workload. Two of them woke the sidecar for nothing most of the time
(benchmarks/README.md, "sixteenth pass"): the memory worker, which re-reads the process's
resident memory for the memory tracker 20 times a second (~2.5 ms of CPU a second, idle or
not), and each table's merge assignee, which polls again 0.1 s after finding nothing to
merge, backing off by x1.1 (eight tables; every insert halves the backoff).
``EMBEDDED_OPTIONS`` slows both; an insert still schedules its table's assignee at once, so
merges and TTL drops are not delayed by them. Inserts run on the calling thread
(``INSERT_SETTINGS``). Options apply when a process first opens a chDB path: later
connections share that engine as it was opened (the sidecar's writer opens it first).
"""

from __future__ import annotations

from typing import Any

EMBEDDED_OPTIONS: dict[str, int] = {
    "memory_worker_period_ms": 1000,
    "background_processing_pool_thread_sleep_seconds_if_nothing_to_do": 1,
    "background_processing_pool_task_sleep_seconds_when_no_work_multiplier": 2,
}
"""chDB engine options (ClickHouse server configuration keys) the embedded store opens with."""

INSERT_SETTINGS: dict[str, int] = {"max_threads": 1, "max_insert_threads": 1}
"""Query settings of every insert into the embedded store. A batch is a few hundred to a few
thousand rows: handing it to pipeline threads woke a pool thread ~10 times an insert for
5-10% more instructions (benchmarks/README.md, "sixteenth pass"). chDB releases the GIL
while it runs a query, so the sending thread doing that work itself holds up no other
thread."""


def connect(dsn: str, embedded: bool, **kwargs: Any) -> Any:
    """A clickhouse-connect client for ``dsn``; an embedded store opened with
    ``EMBEDDED_OPTIONS``."""
    import clickhouse_connect

    if embedded:
        return clickhouse_connect.get_client(dsn=dsn, chdb_options=EMBEDDED_OPTIONS, **kwargs)
    return clickhouse_connect.get_client(dsn=dsn, **kwargs)
