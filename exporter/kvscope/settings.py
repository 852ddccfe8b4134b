"""Every setting of the sidecar distribution, declared once: name, environment variable,
flag, type, default and help (in the style of vLLM's ``envs.py``).

``kvscope serve``'s flags (``add_flags``), its ``KVSCOPE_*`` variables
(``kvscope.sidecar.config.ENV``), ``ServeConfig``'s defaults and the README's configuration
table (``markdown_table``, checked by a drift test) all come from ``SETTINGS``. Commands that
read the same store (``kvscope query``) ask ``store_dsn`` rather than work it out again.
The probe's own variables are read by ``kvscope_probe`` (its own distribution).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvscope_probe.transport import ENV_SECRET, ENV_SECRET_FILE


def default_data_dir(env: Mapping[str, str] | None = None) -> str:
    """Where the embedded store lives: $XDG_DATA_HOME/kvscope or ~/.local/share/kvscope."""
    env = os.environ if env is None else env
    base = env.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(os.path.abspath(base), "kvscope")


def default_endpoint() -> str:
    """A per-user ipc socket; the probe connects where the sidecar binds."""
    return f"ipc://{tempfile.gettempdir()}/kvscope-{os.getuid()}/probe.sock"


@dataclass(frozen=True)
class Setting:
    name: str
    """The ``ServeConfig`` field."""
    env: str
    """The environment variable; a flag given on the command line wins over it."""
    flag: str | None
    """The ``kvscope serve`` flag; None for a setting read only from the environment."""
    type: Callable[[str], Any]
    """Parses the flag's or the variable's text."""
    default: Any
    """The value when neither is given; a callable is called for it."""
    shown: str
    """The default as the README and ``--help`` show it."""
    help: str
    """One line: what it does."""
    repeatable: bool = False
    """The flag may be given more than once (the variable is then comma-separated)."""

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default


def _endpoints(raw: str | list[str]) -> tuple[str, ...]:
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    return tuple(i.strip() for i in items if i.strip())


SETTINGS: tuple[Setting, ...] = (
    Setting("endpoints", "KVSCOPE_PROBE_ENDPOINT", "--endpoint", _endpoints,
            lambda: (default_endpoint(),), "`ipc://$TMPDIR/kvscope-$UID/probe.sock`",
            "where probes and the middleware connect", repeatable=True),
    Setting("host", "KVSCOPE_HOST", "--host", str, "127.0.0.1", "`127.0.0.1`",
            "HTTP bind address; anything but loopback requires a token"),
    Setting("port", "KVSCOPE_PORT", "--port", int, 9477, "`9477`", "HTTP port"),
    Setting("token", "KVSCOPE_TOKEN", "--token", str, None, "none",
            "bearer token for every route but `/healthz` and `/readyz` (`/ui?token=` for "
            "the page)"),
    Setting("health_timeout_s", "KVSCOPE_HEALTH_TIMEOUT_S", "--health-timeout", float, 30.0,
            "`30`", "a probe heard from (records or heartbeats) within this long is "
            "connected; one silent longer fails `/readyz`; at least 4 (twice the 2 s "
            "heartbeat)"),
    Setting("probe_secret_file", ENV_SECRET_FILE, "--probe-secret-file", str, None, "none",
            "file holding the shared secret `tcp://` endpoints require (CURVE)"),
    Setting("probe_secret", ENV_SECRET, None, str, None, "none",
            "that secret itself (environment only, never a flag)"),
    Setting("receive_buffer_bytes", "KVSCOPE_RECEIVE_BUFFER_BYTES", "--receive-buffer-bytes",
            int, 256 << 20, "256 MiB",
            "received frames held for ingestion; more are refused and counted"),
    Setting("vllm_url", "KVSCOPE_VLLM_URL", "--vllm-url", str, None, "none",
            "also scrape vLLM's `/metrics` (coarse mode, reconciliation)"),
    Setting("vllm_scrape_interval_s", "KVSCOPE_VLLM_SCRAPE_INTERVAL_S",
            "--vllm-scrape-interval", float, 5.0, "`5`", "seconds between those scrapes"),
    Setting("clickhouse_dsn", "KVSCOPE_CLICKHOUSE_DSN", "--clickhouse-dsn", str, None,
            "embedded chDB in the data dir",
            "`http(s)://user:pass@host:8123/db`, `chdb:///path`, or `off`"),
    Setting("clickhouse_ttl_days", "KVSCOPE_CLICKHOUSE_TTL_DAYS", "--clickhouse-ttl-days",
            int, 30, "`30`", "days ClickHouse keeps rows"),
    Setting("clickhouse_batch_interval_s", "KVSCOPE_CLICKHOUSE_BATCH_INTERVAL_S",
            "--clickhouse-batch-interval", float, 5.0, "`5`",
            "seconds a table's rows gather in memory before they are spooled to disk as one "
            "batch (and sent, unless the insert interval is longer): each insert has a fixed "
            "cost in the store (at 1 the embedded chDB's threads used four times the CPU); "
            "rows reach a server up to this late (the sidecar's own readers, explain's API "
            "and the layout history, first deliver what waits)"),
    Setting("clickhouse_insert_interval_s", "KVSCOPE_CLICKHOUSE_INSERT_INTERVAL_S",
            "--clickhouse-insert-interval", float, None, "`30` embedded, `0` a server",
            "seconds a table's spooled batches wait to go into the store as one insert (rows "
            "are on disk every batch interval meanwhile); the embedded store's inserts cost "
            "the sidecar's own CPU, about the same whatever their rows, and its readers go "
            "through the sidecar, which delivers first; `0`: each batch at once"),
    Setting("data_dir", "KVSCOPE_DATA_DIR", "--data-dir", str, default_data_dir,
            "`$XDG_DATA_HOME/kvscope`, else `~/.local/share/kvscope`",
            "embedded store and the on-disk spool"),
    Setting("layout_interval_s", "KVSCOPE_LAYOUT_INTERVAL_S", "--layout-interval", float,
            1.0, "`1`", "seconds between layout samples per engine"),
    Setting("layout_store_interval_s", "KVSCOPE_LAYOUT_STORE_INTERVAL_S",
            "--layout-store-interval", float, 60.0, "`60`",
            "seconds between the layout samples kept in ClickHouse per engine; the two "
            "samples around a preemption are kept too (a pair in 10 s at most), an unchanged "
            "pool once in 5 min"),
    Setting("layout_history_bytes", "KVSCOPE_LAYOUT_HISTORY_BYTES", "--layout-history-bytes",
            int, 64 << 20, "64 MiB",
            "layout samples held in memory per engine for `/api/layout/history` (at "
            "most 600 of them): the history fills in the first minutes and then holds this "
            "much per engine; at least 1 MiB"),
    Setting("loki_url", "KVSCOPE_LOKI_URL", "--loki-url", str, None, "none",
            "also push decisions to Loki's HTTP API (spooled and replayed like ClickHouse "
            "rows)"),
    Setting("loki_tenant", "KVSCOPE_LOKI_TENANT", "--loki-tenant", str, None, "none",
            "X-Scope-OrgID for a multi-tenant Loki"),
    Setting("decision_log", "KVSCOPE_DECISION_LOG", "--decision-log", str, "-",
            "`-` (stdout)", "a file (size-rotated), `-`, or `off`"),
    Setting("decision_log_max_bytes", "KVSCOPE_DECISION_LOG_MAX_BYTES",
            "--decision-log-max-bytes", int, 50 << 20, "50 MiB", "rotation size"),
    Setting("tls_cert", "KVSCOPE_TLS_CERT", "--tls-cert", str, None, "none",
            "PEM certificate: serve HTTPS (with `--tls-key`)"),
    Setting("tls_key", "KVSCOPE_TLS_KEY", "--tls-key", str, None, "none",
            "PEM private key of that certificate"),
    Setting("hash_key_file", "KVSCOPE_HASH_KEY_FILE", "--hash-key-file", str, None,
            "`<data dir>/hash.key`, generated",
            "the secret that keys stored prompt and API-key hashes (at least 16 bytes)"),
    Setting("log_level", "KVSCOPE_LOG_LEVEL", "--log-level", str, "info", "`info`",
            "debug, info, warning or error"),
)
BY_NAME = {s.name: s for s in SETTINGS}


def default(name: str) -> Any:
    """The default of one setting (for a dataclass field)."""
    return BY_NAME[name].default_value()


def store_dsn(clickhouse_dsn: str | None, data_dir: str) -> str | None:
    """The ClickHouse DSN that ``kvscope serve`` writes to; None when the store is off."""
    if clickhouse_dsn == "off":
        return None
    return clickhouse_dsn or f"chdb://{os.path.join(data_dir, 'chdb')}"


def env_store_dsn(env: Mapping[str, str] | None = None) -> str | None:
    """``store_dsn`` as the environment sets it, for commands that read serve's store."""
    env = os.environ if env is None else env
    data_dir = env.get(BY_NAME["data_dir"].env) or default_data_dir(env)
    return store_dsn(env.get(BY_NAME["clickhouse_dsn"].env) or None, data_dir)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every setting with a flag, as an option that leaves None when not given."""
    for s in SETTINGS:
        if s.flag is None:
            continue
        extra: dict[str, Any] = {"action": "append"} if s.repeatable else {}
        if s.type in (int, float):
            extra["type"] = s.type
        parser.add_argument(s.flag, dest=s.name, help=f"{s.help.replace('%', '%%')}; "
                            f"default {s.shown} [{s.env}]", **extra)


def markdown_table() -> str:
    """The README's table of ``kvscope serve``'s settings."""
    lines = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        flag = "none" if s.flag is None else f"`{s.flag}`" + (
            " (repeatable)" if s.repeatable else "")
        env = f"`{s.env}`" + (" (comma-separated)" if s.repeatable else "")
        lines.append(f"| {flag} | {env} | {s.shown} | {s.help} |")
    return "\n".join(lines)
