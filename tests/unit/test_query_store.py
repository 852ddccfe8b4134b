"""``kvscope query`` reads the store ``kvscope serve`` writes, under every environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.cli import main
from kvscope.sidecar.config import from_sources
from kvscope.store import query

ENVS = [
    {"KVSCOPE_DATA_DIR": "/srv/kvscope"},
    {"KVSCOPE_DATA_DIR": "/srv/kvscope", "XDG_DATA_HOME": "/home/u/.data"},
    {"XDG_DATA_HOME": "/home/u/.data"},
    {"KVSCOPE_CLICKHOUSE_DSN": "http://ch:8123/kv", "KVSCOPE_DATA_DIR": "/srv/kvscope"},
    {},
]


@pytest.mark.parametrize("env", ENVS)
def test_query_defaults_to_the_store_serve_writes(env: dict[str, str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVSCOPE_DATA_DIR", "XDG_DATA_HOME", "KVSCOPE_CLICKHOUSE_DSN"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert query.default_dsn() == from_sources({}).store_dsn()


def test_query_looks_for_the_store_under_kvscope_data_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The real command, with no --dsn: the store it opens is the data directory's."""
    monkeypatch.delenv("KVSCOPE_CLICKHOUSE_DSN", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path / "data"))
    assert main(["query", "hourly_preemptions"]) == 1
    err = capsys.readouterr().err
    assert err == f"kvscope query: FileNotFoundError: no chDB store at {tmp_path}/data/chdb\n"
