"""One typed configuration for ``kvscope serve``, validated once, every error at once.

Every option is a CLI flag and a ``KVSCOPE_*`` environment variable; the flag wins.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from kvscope.errors import ConfigError
from kvscope.settings import BY_NAME, SETTINGS, default, store_dsn
from kvscope_probe.transport import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    TransportError,
    read_secret,
    requires_auth,
)

MIN_HEALTH_TIMEOUT_S = 4.0
"""Twice kvscope_probe.sender.HEARTBEAT_S."""
EMBEDDED_INSERT_INTERVAL_S = 30.0
"""The embedded store's insert interval unless set: each insert costs its CPU about the same
whatever its rows (benchmarks/README.md, "eighteenth pass"), and what reads it is the
sidecar, which delivers what waits before it reads. A server's readers (Grafana) read it
directly, and its inserts cost the server, not the sidecar: each batch goes at once."""


@dataclass(frozen=True)
class ServeConfig:
    """``kvscope serve``'s settings; what each means, its variable, flag and default are in
    ``kvscope.settings.SETTINGS``."""

    endpoints: tuple[str, ...] = field(default_factory=lambda: default("endpoints"))
    host: str = default("host")
    port: int = default("port")
    health_timeout_s: float = default("health_timeout_s")
    vllm_url: str | None = default("vllm_url")
    vllm_scrape_interval_s: float = default("vllm_scrape_interval_s")
    token: str | None = field(default=default("token"), repr=False)
    log_level: str = default("log_level")
    decision_log: str = default("decision_log")
    decision_log_max_bytes: int = default("decision_log_max_bytes")
    clickhouse_dsn: str | None = field(default=default("clickhouse_dsn"), repr=False)
    clickhouse_ttl_days: int = default("clickhouse_ttl_days")
    clickhouse_batch_interval_s: float = default("clickhouse_batch_interval_s")
    clickhouse_insert_interval_s: float | None = default("clickhouse_insert_interval_s")
    data_dir: str = field(default_factory=lambda: default("data_dir"))
    loki_url: str | None = field(default=default("loki_url"), repr=False)
    loki_tenant: str | None = default("loki_tenant")
    layout_interval_s: float = default("layout_interval_s")
    layout_store_interval_s: float = default("layout_store_interval_s")
    layout_history_bytes: int = default("layout_history_bytes")
    tls_cert: str | None = default("tls_cert")
    tls_key: str | None = field(default=default("tls_key"), repr=False)
    hash_key_file: str | None = default("hash_key_file")
    probe_secret: str | None = field(default=default("probe_secret"), repr=False)
    probe_secret_file: str | None = default("probe_secret_file")
    receive_buffer_bytes: int = default("receive_buffer_bytes")

    def secret(self) -> bytes | None:
        """The probe secret from its value or file (raises TransportError when unusable)."""
        return read_secret({ENV_SECRET: self.probe_secret or "",
                            ENV_SECRET_FILE: self.probe_secret_file or ""})

    def store_dsn(self) -> str | None:
        """The ClickHouse DSN to write to, None when the store is off."""
        return store_dsn(self.clickhouse_dsn, self.data_dir)

    def store_insert_interval_s(self) -> float:
        """Seconds a table's spooled batches wait to go to the store as one insert:
        ``EMBEDDED_INSERT_INTERVAL_S`` for the embedded store unless set, else none."""
        if self.clickhouse_insert_interval_s is not None:
            return self.clickhouse_insert_interval_s
        dsn = self.store_dsn()
        return EMBEDDED_INSERT_INTERVAL_S if dsn and dsn.startswith("chdb://") else 0.0

    def validate(self) -> None:
        errors: list[str] = []
        if not self.endpoints:
            errors.append("at least one probe endpoint is needed")
        for ep in self.endpoints:
            if not ep.startswith(("ipc://", "tcp://")):
                errors.append(f"probe endpoint {ep!r} must start with ipc:// or tcp://")
        try:
            secret = self.secret()
        except TransportError as exc:
            errors.append(str(exc))
            secret = b"unusable"
        tcp = [ep for ep in self.endpoints if requires_auth(ep)]
        if tcp and secret is None:
            errors.append(f"tcp probe endpoints ({', '.join(tcp)}) need the probe secret: set "
                          f"{ENV_SECRET} or --probe-secret-file (openssl rand -hex 32)")
        if self.receive_buffer_bytes < 1 << 20:
            errors.append("receive buffer must be at least 1 MiB")
        if not 0 < self.port < 65536:
            errors.append(f"port {self.port} is outside 1-65535")
        if self.health_timeout_s < MIN_HEALTH_TIMEOUT_S:
            errors.append(f"health timeout must be at least {MIN_HEALTH_TIMEOUT_S:g} s: twice "
                          "the probe's heartbeat interval, or idle engines would flap")
        if self.vllm_scrape_interval_s <= 0:
            errors.append("vLLM scrape interval must be positive")
        if self.vllm_url is not None:
            parts = urlsplit(self.vllm_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                errors.append("vLLM URL must be http(s)://host[:port]")
        if not _is_loopback(self.host) and not self.token:
            errors.append(
                f"binding {self.host} (not loopback) needs a token (--token / KVSCOPE_TOKEN)"
            )
        if self.clickhouse_dsn not in (None, "off") and not self.clickhouse_dsn.startswith(
            ("http://", "https://", "chdb://")
        ):
            errors.append("ClickHouse DSN must start with http://, https:// or chdb://, or be off")
        if self.loki_url is not None and not self.loki_url.startswith(("http://", "https://")):
            errors.append("Loki URL must start with http:// or https://")
        if self.clickhouse_ttl_days < 1:
            errors.append("ClickHouse TTL must be at least 1 day")
        if not 0.1 <= self.clickhouse_batch_interval_s <= 60:
            errors.append("ClickHouse batch interval must be between 0.1 and 60 seconds")
        if not 0 <= self.store_insert_interval_s() <= 600:
            errors.append("ClickHouse insert interval must be between 0 and 600 seconds")
        if not 0.05 <= self.layout_interval_s <= 3600:
            errors.append("layout interval must be between 0.05 and 3600 seconds")
        if not 0.05 <= self.layout_store_interval_s <= 86400:
            errors.append("layout store interval must be between 0.05 and 86400 seconds")
        if self.layout_history_bytes < 1 << 20:
            errors.append("layout history must be at least 1 MiB")
        if self.decision_log_max_bytes < 4096:
            errors.append("decision log rotation size must be at least 4096 bytes")
        if bool(self.tls_cert) != bool(self.tls_key):
            errors.append("TLS needs both --tls-cert and --tls-key")
        for what, path in (("certificate", self.tls_cert), ("key", self.tls_key)):
            if path and not os.path.isfile(path):
                errors.append(f"TLS {what} {path!r} is not a file")
        if self.hash_key_file and not os.path.isfile(self.hash_key_file):
            errors.append(f"hash key file {self.hash_key_file!r} is not a file")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            errors.append(f"log level {self.log_level!r} is not debug/info/warning/error")
        if errors:
            raise ConfigError(errors)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ENV = {s.name: s.env for s in SETTINGS}
"""Each setting's environment variable."""


def from_sources(cli: dict[str, Any], env: dict[str, str] | None = None) -> ServeConfig:
    """Merge CLI values (None = not given) over environment over defaults, then validate."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    errors: list[str] = []
    types = {f.name: f.type for f in fields(ServeConfig)}
    for name, var in ENV.items():
        raw = cli.get(name)
        if raw is None and env.get(var):
            raw = env[var]
        if raw is None:
            continue
        try:
            values[name] = _convert(name, types[name], raw)
        except ValueError:
            errors.append(f"{name} ({var}): cannot read {raw!r}")
    if errors:
        raise ConfigError(errors)
    cfg = ServeConfig(**values)
    cfg.validate()
    return cfg


def _convert(name: str, typ: Any, raw: Any) -> Any:
    if name == "endpoints" or BY_NAME[name].type in (int, float):
        return BY_NAME[name].type(raw)
    return str(raw)
