"""One typed configuration for ``kvscope serve``, validated once, every error at once.

Every option is a CLI flag and a ``KVSCOPE_*`` environment variable; the flag wins.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from kvscope.errors import ConfigError
from kvscope_probe.transport import (
    ENV_SECRET,
    ENV_SECRET_FILE,
    TransportError,
    read_secret,
    requires_auth,
)

MIN_HEALTH_TIMEOUT_S = 4.0
"""Twice kvscope_probe.sender.HEARTBEAT_S."""


def default_data_dir() -> str:
    """Where the embedded store lives: $XDG_DATA_HOME/kvscope or ~/.local/share/kvscope."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(os.path.abspath(base), "kvscope")


def default_endpoint() -> str:
    """A per-user ipc socket; the probe connects where the sidecar binds."""
    return f"ipc://{tempfile.gettempdir()}/kvscope-{os.getuid()}/probe.sock"


@dataclass(frozen=True)
class ServeConfig:
    endpoints: tuple[str, ...] = field(default_factory=lambda: (default_endpoint(),))
    """ZMQ endpoints to bind for probes (env KVSCOPE_PROBE_ENDPOINT, comma-separated)."""
    host: str = "127.0.0.1"
    """HTTP bind address (env KVSCOPE_HOST)."""
    port: int = 9477
    """HTTP port (env KVSCOPE_PORT)."""
    health_timeout_s: float = 30.0
    """A probe heard from (records or heartbeats) within this long is connected; /readyz
    fails while one is silent longer (env KVSCOPE_HEALTH_TIMEOUT_S)."""
    vllm_url: str | None = None
    """vLLM server to scrape for coarse metrics and reconciliation (env KVSCOPE_VLLM_URL)."""
    vllm_scrape_interval_s: float = 5.0
    """Seconds between scrapes of vLLM's /metrics (env KVSCOPE_VLLM_SCRAPE_INTERVAL_S)."""
    token: str | None = field(default=None, repr=False)
    """Bearer token required on every route but /healthz (env KVSCOPE_TOKEN)."""
    log_level: str = "info"
    """Log level (env KVSCOPE_LOG_LEVEL)."""
    decision_log: str = "-"
    """Decision log: a file path (rotated), "-" for stdout, "off" (env KVSCOPE_DECISION_LOG)."""
    decision_log_max_bytes: int = 50 << 20
    """Rotate the decision log file at this size (env KVSCOPE_DECISION_LOG_MAX_BYTES)."""
    clickhouse_dsn: str | None = field(default=None, repr=False)
    """ClickHouse: http(s)://user:pass@host:port/db, chdb:///path, or "off"; default the
    embedded chDB under the data directory (env KVSCOPE_CLICKHOUSE_DSN)."""
    clickhouse_ttl_days: int = 30
    """Days ClickHouse keeps rows (env KVSCOPE_CLICKHOUSE_TTL_DAYS)."""
    data_dir: str = field(default_factory=default_data_dir)
    """Embedded chDB store and its spool (env KVSCOPE_DATA_DIR)."""
    loki_url: str | None = field(default=None, repr=False)
    """Also push decisions to Loki's HTTP API at this base URL (env KVSCOPE_LOKI_URL)."""
    loki_tenant: str | None = None
    """X-Scope-OrgID for a multi-tenant Loki (env KVSCOPE_LOKI_TENANT)."""
    layout_interval_s: float = 1.0
    """Seconds between block-layout samples per engine (env KVSCOPE_LAYOUT_INTERVAL_S)."""
    tls_cert: str | None = None
    """PEM certificate (chain): serve HTTPS instead of HTTP (env KVSCOPE_TLS_CERT)."""
    tls_key: str | None = field(default=None, repr=False)
    """PEM private key of that certificate (env KVSCOPE_TLS_KEY)."""
    hash_key_file: str | None = None
    """Secret that keys prompt and API-key hashes; default ``<data dir>/hash.key``,
    generated when absent (env KVSCOPE_HASH_KEY_FILE)."""
    probe_secret: str | None = field(default=None, repr=False)
    """Shared secret of probes and sidecar; tcp endpoints require it (CURVE keys derive from
    it). Environment only, never a flag (env KVSCOPE_PROBE_SECRET)."""
    probe_secret_file: str | None = None
    """File holding that secret (env KVSCOPE_PROBE_SECRET_FILE)."""
    receive_buffer_bytes: int = 256 << 20
    """Bytes of received frames held for ingestion; more are refused and counted
    (env KVSCOPE_RECEIVE_BUFFER_BYTES)."""

    def secret(self) -> bytes | None:
        """The probe secret from its value or file (raises TransportError when unusable)."""
        return read_secret({ENV_SECRET: self.probe_secret or "",
                            ENV_SECRET_FILE: self.probe_secret_file or ""})

    def store_dsn(self) -> str | None:
        """The ClickHouse DSN to write to, None when the store is off."""
        if self.clickhouse_dsn == "off":
            return None
        return self.clickhouse_dsn or f"chdb://{os.path.join(self.data_dir, 'chdb')}"

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
        if not 0.05 <= self.layout_interval_s <= 3600:
            errors.append("layout interval must be between 0.05 and 3600 seconds")
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


ENV = {
    "endpoints": "KVSCOPE_PROBE_ENDPOINT",
    "host": "KVSCOPE_HOST",
    "port": "KVSCOPE_PORT",
    "health_timeout_s": "KVSCOPE_HEALTH_TIMEOUT_S",
    "vllm_url": "KVSCOPE_VLLM_URL",
    "vllm_scrape_interval_s": "KVSCOPE_VLLM_SCRAPE_INTERVAL_S",
    "token": "KVSCOPE_TOKEN",
    "log_level": "KVSCOPE_LOG_LEVEL",
    "decision_log": "KVSCOPE_DECISION_LOG",
    "decision_log_max_bytes": "KVSCOPE_DECISION_LOG_MAX_BYTES",
    "clickhouse_dsn": "KVSCOPE_CLICKHOUSE_DSN",
    "clickhouse_ttl_days": "KVSCOPE_CLICKHOUSE_TTL_DAYS",
    "data_dir": "KVSCOPE_DATA_DIR",
    "layout_interval_s": "KVSCOPE_LAYOUT_INTERVAL_S",
    "loki_url": "KVSCOPE_LOKI_URL",
    "loki_tenant": "KVSCOPE_LOKI_TENANT",
    "tls_cert": "KVSCOPE_TLS_CERT",
    "tls_key": "KVSCOPE_TLS_KEY",
    "hash_key_file": "KVSCOPE_HASH_KEY_FILE",
    "probe_secret": ENV_SECRET,
    "probe_secret_file": ENV_SECRET_FILE,
    "receive_buffer_bytes": "KVSCOPE_RECEIVE_BUFFER_BYTES",
}


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
    if name == "endpoints":
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        return tuple(i.strip() for i in items if i.strip())
    if "int" in str(typ):
        return int(raw)
    if "float" in str(typ):
        return float(raw)
    return str(raw)
