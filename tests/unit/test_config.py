"""One typed config: flags over environment over defaults, all errors at once."""

from __future__ import annotations

import pytest

from kvscope.errors import ConfigError
from kvscope.sidecar.config import ServeConfig, from_sources


def test_defaults_bind_loopback() -> None:
    cfg = from_sources({}, env={})
    assert cfg.host == "127.0.0.1" and cfg.endpoints[0].startswith("ipc://")


def test_flag_beats_environment() -> None:
    env = {"KVSCOPE_PORT": "9000", "KVSCOPE_PROBE_ENDPOINT": "tcp://127.0.0.1:5555,ipc:///x",
           "KVSCOPE_PROBE_SECRET": "s" * 32}
    cfg = from_sources({"port": 9100}, env=env)
    assert cfg.port == 9100
    assert cfg.endpoints == ("tcp://127.0.0.1:5555", "ipc:///x")


def test_every_error_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as exc:
        from_sources({"host": "0.0.0.0", "port": 0, "endpoints": ["udp://x"],
                      "vllm_url": "ftp://x", "log_level": "loud"}, env={})
    assert len(exc.value.errors) == 5
    assert any("token" in e for e in exc.value.errors)


def test_unreadable_values_are_errors_not_tracebacks() -> None:
    with pytest.raises(ConfigError) as exc:
        from_sources({}, env={"KVSCOPE_PORT": "many", "KVSCOPE_HEALTH_TIMEOUT_S": "soon"})
    assert len(exc.value.errors) == 2


def test_token_allows_a_public_bind_and_is_not_in_repr() -> None:
    cfg = ServeConfig(host="0.0.0.0", token="s3cret")
    cfg.validate()
    assert "s3cret" not in repr(cfg)


def test_the_clickhouse_batch_interval_reaches_the_sink(tmp_path: object) -> None:
    from kvscope.sidecar.server import open_sinks

    cfg = from_sources({"clickhouse_dsn": "http://127.0.0.1:9", "data_dir": str(tmp_path)},
                       env={"KVSCOPE_CLICKHOUSE_BATCH_INTERVAL_S": "2.5"})
    assert cfg.clickhouse_batch_interval_s == 2.5
    sinks, store = open_sinks(cfg)
    try:
        assert store is not None and store.options.batch_interval_s == 2.5
        assert store.delivery.opt.batch_interval_s == 2.5
    finally:
        sinks.close(0.5)
    for bad in ("0", "61", "-1"):
        with pytest.raises(ConfigError) as exc:
            from_sources({}, env={"KVSCOPE_CLICKHOUSE_BATCH_INTERVAL_S": bad})
        assert any("batch interval" in e for e in exc.value.errors)


def test_the_embedded_store_inserts_every_30_s_unless_told_and_a_server_at_once(
        tmp_path: object) -> None:
    """Its inserts cost the sidecar's own CPU and its readers go through the sidecar; a
    server's readers (Grafana) read the server."""
    assert ServeConfig(data_dir=str(tmp_path)).store_insert_interval_s() == 30.0
    assert ServeConfig(clickhouse_dsn="http://127.0.0.1:9").store_insert_interval_s() == 0.0
    cfg = from_sources({"data_dir": str(tmp_path)},
                       env={"KVSCOPE_CLICKHOUSE_INSERT_INTERVAL_S": "12"})
    assert cfg.store_insert_interval_s() == 12.0
    for bad in ("-1", "601"):
        with pytest.raises(ConfigError) as exc:
            from_sources({}, env={"KVSCOPE_CLICKHOUSE_INSERT_INTERVAL_S": bad})
        assert any("insert interval" in e for e in exc.value.errors)
