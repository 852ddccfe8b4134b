"""ClickHouse DDL and saved queries: the ``.sql`` files shipped in ``kvscope/store/clickhouse/``.

``schema/*.sql`` is applied in name order, idempotently (``IF NOT EXISTS``), with three
placeholders: ``{database}``, ``{ttl_days}`` and ``{dedup_window}`` (``DEDUP_WINDOW``, or
``EMBEDDED_DEDUP_WINDOW`` for the embedded store). The same files render a cluster variant:
each ``ENGINE = MergeTree`` table becomes ``<name>_local`` on ``ReplicatedMergeTree`` plus a
``Distributed`` table under the original name, every statement ``ON CLUSTER``. Inserts then
go to the Distributed table unchanged; its sharding key must be a function of the row (a
retried batch must land on the same shards for the dedup token to work): the default is
``cityHash64(model, server, engine)`` (the engine's identity: vLLM's engine label alone takes
a handful of values across a fleet), a file may override it with ``-- kvscope:sharding_key EXPR``.

Views (``CREATE OR REPLACE VIEW``, over those table names) are replaced on every apply and
created ``ON CLUSTER`` as they are.

``kvscope schema [--cluster NAME]`` prints the DDL.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_DATABASE = "kvscope"
DEFAULT_TTL_DAYS = 30
DEFAULT_SHARDING_KEY = "cityHash64(model, server, engine)"
DEDUP_WINDOW = 100_000
"""Inserts a table remembers by dedup token on a server the fleet shares: a re-send is stored
once if fewer inserts than this reached its table since its first send. 125 sidecars
inserting a table every 5 s make 25 a second: 100,000 is 67 min, 8 min at 1,000 sidecars,
past a retry (90 s) and a crash-looping sidecar's replay (5 min); about 22 MB of the
server's memory a table (clickhouse/README.md, "Dedup window")."""
EMBEDDED_DEDUP_WINDOW = 1_000
"""The same for the embedded store, which one sidecar alone writes, oldest batch first: no
insert reaches a table between a batch's first send and its re-send, and the window's
memory would be the sidecar's own."""
_SHARDING = re.compile(r"--\s*kvscope:sharding_key\s+(.+)$", re.MULTILINE)
_CREATE_TABLE = re.compile(
    r"^CREATE\s+TABLE\s+IF\s+NOT\s+EXISTS\s+(\w+)\.(\w+)\s*(\(.*\))\s*"
    r"ENGINE\s*=\s*MergeTree(?:\(\))?\s+(.*)$", re.IGNORECASE | re.DOTALL)
_ALTER_TABLE = re.compile(r"^ALTER\s+TABLE\s+(\w+)\.(\w+)\s+(.*)$", re.IGNORECASE | re.DOTALL)
_MODIFY_SETTING = re.compile(r"^MODIFY\s+SETTING\s", re.IGNORECASE)
_CREATE_DB = re.compile(r"^CREATE\s+DATABASE\s+IF\s+NOT\s+EXISTS\s+(\w+)$", re.IGNORECASE)
_CREATE_VIEW = re.compile(r"^CREATE\s+OR\s+REPLACE\s+VIEW\s+(\w+)\.(\w+)\s+AS\s+(.*)$",
                          re.IGNORECASE | re.DOTALL)


def sql_files(kind: str) -> list[Traversable]:
    """The shipped ``.sql`` files of ``schema`` or ``queries``, in name order."""
    root = resources.files("kvscope.store").joinpath("clickhouse").joinpath(kind)
    return sorted((f for f in root.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)


def split_statements(sql: str) -> list[str]:
    """Statements of a file, comments dropped, split on ``;`` outside quotes."""
    out: list[str] = []
    buf: list[str] = []
    quote = ""
    i = 0
    while i < len(sql):
        ch = sql[i]
        if quote:
            buf.append(ch)
            if ch == "\\" and i + 1 < len(sql):
                buf.append(sql[i + 1])
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"`":
            quote = ch
            buf.append(ch)
        elif sql.startswith("--", i):
            i = sql.find("\n", i)
            if i < 0:
                break
            continue
        elif ch == ";":
            out.append("".join(buf).strip())
            buf = []
        else:
            buf.append(ch)
        i += 1
    out.append("".join(buf).strip())
    return [s for s in out if s]


def check_names(database: str, ttl_days: int, cluster: str | None = None,
                dedup_window: int = DEDUP_WINDOW) -> list[str]:
    """Every problem with these schema options (empty when usable)."""
    errors = []
    if not IDENT.match(database):
        errors.append(f"database {database!r} must be a plain identifier")
    if not isinstance(ttl_days, int) or ttl_days < 1:
        errors.append(f"ttl_days must be a whole number of days >= 1, got {ttl_days!r}")
    if cluster is not None and not IDENT.match(cluster):
        errors.append(f"cluster {cluster!r} must be a plain identifier")
    if not isinstance(dedup_window, int) or dedup_window < 1:
        errors.append(f"dedup_window must be a whole number of inserts >= 1, got "
                      f"{dedup_window!r}")
    return errors


def render_schema(database: str = DEFAULT_DATABASE, ttl_days: int = DEFAULT_TTL_DAYS,
                  cluster: str | None = None, dedup_window: int = DEDUP_WINDOW) -> list[str]:
    """Every DDL statement of ``schema/*.sql`` in order, placeholders filled."""
    errors = check_names(database, ttl_days, cluster, dedup_window)
    if errors:
        raise ValueError("; ".join(errors))
    statements: list[str] = []
    for f in sql_files("schema"):
        text = f.read_text(encoding="utf-8")
        m = _SHARDING.search(text)
        sharding = m.group(1).strip() if m else DEFAULT_SHARDING_KEY
        text = (text.replace("{database}", database).replace("{ttl_days}", str(ttl_days))
                .replace("{dedup_window}", str(dedup_window)))
        for stmt in split_statements(text):
            statements.extend(_on_cluster(stmt, cluster, sharding, f.name) if cluster
                              else [stmt])
    return statements


def table_names() -> set[str]:
    """Tables the DDL creates (a row type without DDL is not taken by the sink)."""
    made = (re.match(r"CREATE\s+TABLE\s+IF\s+NOT\s+EXISTS\s+\w+\.(\w+)", s, re.IGNORECASE)
            for s in render_schema())
    return {m.group(1) for m in made if m}


def view_names() -> set[str]:
    """Views the DDL creates (read-only: over the tables, replaced on every apply)."""
    made = (_CREATE_VIEW.match(s) for s in render_schema())
    return {m.group(2) for m in made if m}


def _on_cluster(stmt: str, cluster: str, sharding: str, source: str) -> list[str]:
    on = f"ON CLUSTER '{cluster}'"
    m = _CREATE_DB.match(stmt)
    if m:
        return [f"CREATE DATABASE IF NOT EXISTS {m.group(1)} {on}"]
    m = _ALTER_TABLE.match(stmt)
    if m:
        db, name, change = m.groups()
        # A column goes to the local and the Distributed table; a MergeTree setting to the
        # local one only (a Distributed table has none of them).
        targets = [f"{name}_local"] + ([] if _MODIFY_SETTING.match(change) else [name])
        return [f"ALTER TABLE {db}.{t} {on} {change}" for t in targets]
    m = _CREATE_VIEW.match(stmt)
    if m:  # over the Distributed tables, which keep the tables' names
        db, name, select = m.groups()
        return [f"CREATE OR REPLACE VIEW {db}.{name} {on} AS {select}"]
    m = _CREATE_TABLE.match(stmt)
    if not m:
        raise ValueError(f"{source}: no cluster variant for statement {stmt[:60]!r}...")
    db, name, body, rest = m.groups()
    # {shard}, {replica}, {database} and {table} are the server's macros here.
    local = (f"CREATE TABLE IF NOT EXISTS {db}.{name}_local {on}\n{body}\n"
             f"ENGINE = ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{{database}}/"
             f"{{table}}', '{{replica}}')\n{rest}")
    dist = (f"CREATE TABLE IF NOT EXISTS {db}.{name} {on} AS {db}.{name}_local\n"
            f"ENGINE = Distributed('{cluster}', '{db}', '{name}_local', {sharding})")
    return [local, dist]


def apply_schema(client: Any, database: str = DEFAULT_DATABASE,
                 ttl_days: int = DEFAULT_TTL_DAYS, cluster: str | None = None,
                 dedup_window: int = DEDUP_WINDOW) -> int:
    """Run every DDL statement on a clickhouse-connect client; returns how many ran."""
    statements = render_schema(database, ttl_days, cluster, dedup_window)
    for stmt in statements:
        client.command(stmt)
    return len(statements)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("schema", help="print kvscope's ClickHouse DDL (single node or "
                                             "cluster)")
    p.add_argument("--cluster", help="render ReplicatedMergeTree + Distributed tables, "
                                     "ON CLUSTER this cluster")
    p.add_argument("--database", default=DEFAULT_DATABASE, help="database name (kvscope)")
    p.add_argument("--ttl-days", type=int, default=DEFAULT_TTL_DAYS,
                   help=f"days rows are kept ({DEFAULT_TTL_DAYS})")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    try:
        statements = render_schema(args.database, args.ttl_days, args.cluster)
    except ValueError as exc:
        print(f"kvscope schema: {exc}", file=sys.stderr)
        return 2
    print(";\n\n".join(statements) + ";")
    return 0
