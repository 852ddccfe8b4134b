"""Layer 2 in ClickHouse, through clickhouse-connect only.

One code path for a server (``http://`` / ``https://``) and the embedded engine
(``chdb:///abs/path``, clickhouse-connect's in-process chDB backend): DDL from
``kvscope/store/clickhouse/schema`` applied at connect, every batch inserted as ``FORMAT Arrow``
with its own ``insert_deduplication_token``. Queueing, spooling and retries live in
``kvscope.sinks.delivery``; this module only knows how to reach the store and insert one
batch. Credentials in a DSN never reach a log line, an error or ``stats()``.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from kvscope.redact import redact
from kvscope.rows import TABLES
from kvscope.sinks.base import BatchRejected, SinkStats, StoreUnavailable
from kvscope.sinks.delivery import Delivery
from kvscope.sinks.options import DeliveryOptions
from kvscope.sinks.spool import Spool, SpooledBatch
from kvscope.store import SINK_NAME, arrow, embedded, schema

NO_SUCH_COLUMN = 16
SCHEMA_CODES = {NO_SUCH_COLUMN, 60, 81}
"""NO_SUCH_COLUMN_IN_TABLE, UNKNOWN_TABLE, UNKNOWN_DATABASE: apply the DDL again. A batch
still refused for a column the table lacks once the DDL was applied again holds a column
this version has no DDL for (spooled by a newer version before a rollback): rejected."""
TRANSIENT_CODES = SCHEMA_CODES | {159, 164, 202, 203, 209, 210, 225, 241, 242, 252, 319,
                                  425, 497, 516, 999}
"""Server answers that say "not now" (timeouts, overload, read-only, auth, keeper):
retried for as long as it takes, the spool bounding what waits."""
REJECT_AFTER = 5
"""Attempts before a batch the server keeps refusing for another reason is dropped."""
FRESH_GAP_S = 1.0
"""``fresh`` flushes the sink at most this often: readers in a burst share one flush, so
they force no more than one insert a second per table."""
FRESH_WAIT_S = 2.0
"""How long ``fresh`` waits for that flush (a slow or absent store: the reader reads what
the store has)."""
READ_WAIT_S = 10.0
"""How long a read through the sidecar's API waits for the sink's lock, which the sending
thread holds while it connects and applies the DDL (a minute a statement at worst): then
the read fails (the API answers 503) instead of queueing behind it. Seconds, not one: the
embedded store's DDL alone took over a second on a loaded 2-core machine at start (a
reader of the CI run failed so with 1 s), and a healthy start must not read as down."""



@dataclass(frozen=True)
class Target:
    """Where a DSN points, with what a log line may show."""

    dsn: str
    """What clickhouse-connect connects to (an HTTP DSN without its database path)."""
    safe: str
    """The DSN with the password hidden."""
    database: str | None
    chdb_path: str | None
    secret: str

    @classmethod
    def parse(cls, dsn: str) -> Target:
        parts = urlsplit(dsn)
        secret = _raw_password(dsn)
        netloc_userinfo = parts.netloc.rpartition("@")[0]
        if secret is not None and (secret != (parts.password or "")
                                   or any(c.isspace() for c in netloc_userinfo)):
            # urlsplit ended the authority inside the password (at # ? /), so the text it
            # would show as host, port or database is a piece of the password: echo none.
            raise ValueError("ClickHouse DSN: percent-encode special characters in the "
                             "password (# ? / space as %23 %3F %2F %20)")
        safe = redact(dsn)
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            raise ValueError(f"ClickHouse DSN {safe!r}: the port must be a number") from None
        if parts.scheme == "chdb":
            if parts.netloc or not parts.path.startswith("/"):
                raise ValueError(f"chDB DSN {safe!r} must be chdb:///absolute/path")
            return cls(dsn, safe, None, parts.path, "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"ClickHouse DSN {safe!r} must be http(s)://[user[:password]@]"
                             "host[:port][/database] or chdb:///absolute/path")
        database = parts.path.strip("/") or None
        bare = urlunsplit((parts.scheme, parts.netloc, "", parts.query, ""))
        return cls(bare, safe, database, None, parts.password or "")

    def scrub(self, text: str) -> str:
        text = redact(text)
        for secret in {self.secret, unquote(self.secret)} - {""}:
            text = text.replace(secret, "***")
        return text


def _raw_password(dsn: str) -> str | None:
    """The password as written: after the first : of what follows ``scheme://``, up to
    the last @ of the DSN (the greedy reading ``redact`` uses); None without one."""
    m = re.match(r"(?s)[A-Za-z][A-Za-z0-9+.-]*://([^@]*:.*)@", dsn)
    return m[1].partition(":")[2] if m else None


def default_spool_dir(target: Target) -> str:
    if target.chdb_path:
        return target.chdb_path.rstrip("/") + "-spool"
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    host = urlsplit(target.dsn)
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{host.hostname}_{host.port or 'default'}")
    return os.path.join(state, "kvscope", "spool", slug)


class ClickHouseSink:
    """Takes rows of every kvscope table; see kvscope.sinks.delivery for the guarantees."""

    name = SINK_NAME

    def __init__(self, dsn: str, *, database: str | None = None,
                 ttl_days: int = schema.DEFAULT_TTL_DAYS, cluster: str | None = None,
                 options: DeliveryOptions | None = None, spool_dir: str | None = None,
                 connect: Callable[[], Any] | None = None) -> None:
        errors: list[str] = []
        try:
            target: Target | None = Target.parse(dsn)
        except ValueError as exc:
            target = None
            errors.append(str(exc))
        self.database = database or (target and target.database) or schema.DEFAULT_DATABASE
        self.options = options or DeliveryOptions()
        errors += schema.check_names(self.database, ttl_days, cluster) + self.options.validate()
        if errors or target is None:
            raise ValueError("invalid ClickHouse sink settings: " + "; ".join(errors))
        self.target = target
        self.ttl_days, self.cluster = ttl_days, cluster
        self._connect = connect or self._default_connect
        self._client: Any = None
        self._lock = threading.Lock()
        self._fresh_lock = threading.Lock()
        self._fresh_at = float("-inf")
        self._ddl_runs = 0
        """How many times the schema was applied (each connect)."""
        self._column_missing: tuple[int, int] = (0, -1)
        """(batch seq, ``_ddl_runs`` then) of the last batch refused for a missing column."""
        self.spool = Spool(spool_dir or default_spool_dir(self.target),
                           max_bytes=self.options.spool_max_bytes,
                           policy=self.options.spool_policy, fsync=self.options.fsync)
        made = schema.table_names()
        self.tables = frozenset(t for t in TABLES if t in made)
        arrow.use_system_allocator()
        arrow.warm(sorted(self.tables))
        self.delivery = Delivery(self.name, sorted(self.tables), arrow.encode, self._send,
                                 self.spool, self.options, describe=self.describe,
                                 check=self._check,
                                 combine=lambda payloads: memoryview(arrow.concat(payloads)))
        self.delivery.start()

    # -- the Sink protocol ---------------------------------------------------------------
    def accepts(self, table: str) -> bool:
        return table in self.tables

    def write(self, table: str, row: Any) -> None:
        self.delivery.take(table, row)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.delivery.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        delivered = self.delivery.close(timeout_s)
        if self._lock.acquire(timeout=1.0):  # else a connect still hangs on the sending thread
            try:
                self._drop_client()
            finally:
                self._lock.release()
        return delivered

    def stats(self) -> SinkStats:
        return self.delivery.stats()

    def describe(self, exc: BaseException) -> str:
        return self.target.scrub(f"{type(exc).__name__}: {exc}")[:500]

    # -- the store -----------------------------------------------------------------------
    def _default_connect(self) -> Any:
        if self.target.chdb_path:
            os.makedirs(self.target.chdb_path, exist_ok=True)
            return embedded.connect(self.target.dsn, True)
        return embedded.connect(self.target.dsn, False, connect_timeout=5,
                                send_receive_timeout=60, autogenerate_session_id=False)

    def client(self, wait_s: float | None = None) -> Any:
        """A connected client with the schema applied (connects on first use). With
        ``wait_s`` (a reader), ``StoreUnavailable`` when another thread holds the lock
        (connecting) that long."""
        if not self._lock.acquire(timeout=-1 if wait_s is None else wait_s):
            raise StoreUnavailable("the sink is still connecting to its store")
        try:
            if self._client is None:
                client = self._connect()
                window = (schema.EMBEDDED_DEDUP_WINDOW if self.target.chdb_path
                          else schema.DEDUP_WINDOW)
                try:
                    schema.apply_schema(client, self.database, self.ttl_days, self.cluster,
                                        window)
                except Exception:
                    client.close()
                    raise
                self._client = client
                self._ddl_runs += 1
            return self._client
        finally:
            self._lock.release()

    def reader(self) -> Any:
        """A new client on the store's database for reading (the caller closes it); the
        writer's client stays the sink's own."""
        self.client(READ_WAIT_S)  # the schema is applied first
        return embedded.connect(self.target.dsn, bool(self.target.chdb_path),
                                database=self.database)

    def fresh(self) -> None:
        """Deliver the rows taken so far before a read through the sidecar's API (waiting
        at most ``FRESH_WAIT_S``): ``kvscope explain`` answers for a request that ended a
        moment ago, and the layout history has the last samples, whatever
        ``batch_interval_s`` is. At most one flush each ``FRESH_GAP_S`` after the last one
        ended; a reader that waited for a running flush reads what it delivered, so a burst
        of readers costs one flush, however long it took."""
        with self._fresh_lock:
            if time.monotonic() - self._fresh_at >= FRESH_GAP_S:
                self.delivery.flush(FRESH_WAIT_S)
                self._fresh_at = time.monotonic()  # stamped after: the waiters skip

    def fresh_reader(self) -> Any:
        """``reader()`` after ``fresh()``."""
        self.fresh()
        return self.reader()

    def fresh_client(self) -> Any:
        """``client()`` after ``fresh()``, failing rather than waiting ``READ_WAIT_S`` for
        the sending thread's connect."""
        self.fresh()
        return self.client(READ_WAIT_S)

    def _drop_client(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001, S110 - it is being discarded
                pass
            self._client = None

    def _check(self) -> None:
        try:
            self.client().command("SELECT 1")
        except Exception:
            with self._lock:
                self._drop_client()  # connect afresh on the next attempt
            raise

    def _send(self, batch: SpooledBatch, payload: bytes, attempt: int) -> None:
        if batch.table not in self.tables:  # spooled by a version with other tables
            raise BatchRejected(f"no DDL for table {batch.table!r}")
        settings: dict[str, Any] = {"insert_deduplication_token": batch.token}
        if self.cluster:
            settings["distributed_foreground_insert"] = 1  # acknowledged = on the shards
        if self.target.chdb_path:
            settings.update(embedded.INSERT_SETTINGS)
        try:
            columns = arrow.column_names(payload)
        except Exception as exc:  # noqa: BLE001 - damaged on disk: no retry will read it
            raise BatchRejected(f"cannot decode {batch.filename}: {self.describe(exc)}") from None
        try:
            client = self.client()
        except Exception as exc:  # connect or DDL: never charged to the batch
            raise StoreUnavailable(self.describe(exc)) from exc
        try:
            client.raw_insert(f"{self.database}.{batch.table}", columns, payload,
                              settings=settings, fmt="Arrow")
        except Exception as exc:
            code = getattr(exc, "code", None)
            with self._lock:
                if code == NO_SUCH_COLUMN:
                    seq, runs = self._column_missing
                    if seq == batch.seq and self._ddl_runs > runs:  # the DDL did not help
                        raise BatchRejected(self.describe(exc)) from None
                    self._column_missing = (batch.seq, self._ddl_runs)
                if code is None or code in SCHEMA_CODES:
                    self._drop_client()  # reconnect (and apply the DDL) on the next attempt
            if code is not None and code not in TRANSIENT_CODES and attempt + 1 >= REJECT_AFTER:
                raise BatchRejected(self.describe(exc)) from None
            raise
