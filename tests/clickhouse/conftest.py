"""ClickHouse tests on chDB, a real ClickHouse engine running in this process.

chDB opens one data directory per process at a time, so the whole session shares ONE
directory and every test gets its own database in it (``CREATE DATABASE`` per test). Every
client and sink a test opens is closed by the end of the test, so other suites may open
their own directory afterwards. Tests that need a second process on a store (kill -9 and
recovery) run that process on a directory of its own under ``tmp_path``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvscope.sinks.options import DeliveryOptions

pytest.importorskip("chdb")
clickhouse_connect = pytest.importorskip("clickhouse_connect")

FAST = DeliveryOptions(batch_interval_s=0.1, fsync=False, backoff_initial_s=0.02,
                       backoff_max_s=0.2)
"""Delivery options for tests: short batch interval and backoff, no fsync."""


def open_sink(dsn: str, database: str,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """kvscope's ClickHouse sink on ``database`` (the embedded store's path, FAST delivery,
    a spool of its own) and the SinkManager that feeds it, as a test writes its rows."""
    from kvscope.sinks.base import SinkManager
    from kvscope.store.sink import ClickHouseSink

    sink = ClickHouseSink(dsn, database=database, options=FAST,
                          spool_dir=str(tmp_path_factory.mktemp("spool")))
    return sink, SinkManager([sink])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "clickhouse: runs ClickHouse (chDB) in-process")


@pytest.fixture(scope="session")
def chdb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chdb") / "store"


@pytest.fixture(scope="session")
def chdb_dsn(chdb_dir: Path) -> str:
    return f"chdb://{chdb_dir}"


def database_name(nodeid: str) -> str:
    return "t_" + hashlib.sha1(nodeid.encode()).hexdigest()[:12]


@pytest.fixture
def database(request: pytest.FixtureRequest) -> str:
    return database_name(request.node.nodeid)


@pytest.fixture
def store(chdb_dsn: str, database: str) -> Iterator[Any]:
    """A clickhouse-connect client on the session's chDB directory, in this test's database."""
    admin = clickhouse_connect.get_client(dsn=chdb_dsn)
    admin.command(f"DROP DATABASE IF EXISTS {database}")
    admin.command(f"CREATE DATABASE {database}")
    client = clickhouse_connect.get_client(dsn=chdb_dsn, database=database)
    yield client
    client.close()
    admin.close()


def count(client: Any, table: str, where: str = "1") -> int:
    return int(client.query(f"SELECT count() FROM {table} WHERE {where}").result_rows[0][0])


@pytest.fixture(scope="session")
def twin_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
    """run(emit, n_requests, seed, on_step) -> (hub, result): vLLM's real scheduler in the
    twin, the probe attached, every row the RequestTracker makes passed to ``emit``."""
    pytest.importorskip("kvscope.twin.engine")
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("kvscope-cache")))
    from tests.clickhouse.twinrun import run_twin

    yield run_twin
    mp.undo()


@pytest.fixture
def store_rows(chdb_dsn: str, tmp_path_factory: pytest.TempPathFactory,
               request: pytest.FixtureRequest) -> Iterator[Callable[[list[Any]], Any]]:
    """``store(rows)``: the rows written through kvscope's ClickHouse sink (the embedded
    store's path) into a database of their own; a client on it, closed after the test."""
    clients: list[Any] = []

    def store(rows: list[Any]) -> Any:
        db = database_name(f"{request.node.nodeid}#{len(clients)}")
        sink, manager = open_sink(chdb_dsn, db, tmp_path_factory)
        for r in rows:
            manager.emit(r)
        assert sink.flush(60)
        manager.close()
        clients.append(clickhouse_connect.get_client(dsn=chdb_dsn, database=db))
        return clients[-1]

    yield store
    for c in clients:
        c.close()
