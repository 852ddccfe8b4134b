"""``kvscope query NAME``: run a saved query of ``kvscope/store/clickhouse/queries`` and print it.

A saved query is a ``.sql`` file whose leading comment says what it answers. It takes
ClickHouse query parameters (``{name:Type}``); a ``-- @param name = value`` line in that
comment gives a default (``''`` is the empty string), ``--param name=value`` overrides it,
and a parameter with neither is an error. Tables are unqualified: the runner connects to
``--database``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from kvscope.settings import BY_NAME, env_store_dsn
from kvscope.store import embedded, schema

ENV_DSN = BY_NAME["clickhouse_dsn"].env
ENV_DATA_DIR = BY_NAME["data_dir"].env
_PARAM = re.compile(r"\{(\w+):([^{}]+)\}")
_DEFAULT = re.compile(r"^--[ \t]*@param[ \t]+(\w+)[ \t]*=[ \t]*(\S+)", re.MULTILINE)
FORMATS = ("table", "csv", "json")


def default_dsn() -> str:
    """The store ``kvscope serve`` writes with this environment (``kvscope.settings``)."""
    return env_store_dsn() or "off"


@dataclass(frozen=True)
class SavedQuery:
    name: str
    sql: str
    about: str
    """The leading comment, without its @param lines."""
    types: dict[str, str]
    defaults: dict[str, str]

    @classmethod
    def load(cls, name: str) -> SavedQuery:
        files = {f.name[:-4]: f for f in schema.sql_files("queries")}
        if name not in files:
            raise KeyError(f"no saved query {name!r}; there are: {', '.join(sorted(files))}")
        return cls.parse(name, files[name].read_text(encoding="utf-8"))

    @classmethod
    def parse(cls, name: str, sql: str) -> SavedQuery:
        """A query from its text: leading comment, ``@param`` defaults, typed params."""
        head = []
        for line in sql.splitlines():
            if not line.startswith("--"):
                break
            if not _DEFAULT.match(line):
                head.append(line[2:].strip())
        defaults = {k: v[1:-1] if len(v) > 1 and v[0] == v[-1] == "'" else v
                    for k, v in _DEFAULT.findall(sql)}
        return cls(name, sql, " ".join(head), dict(_PARAM.findall(sql)), defaults)

    def bind(self, given: dict[str, str]) -> dict[str, Any]:
        """Typed parameter values: defaults overridden by ``given``; every error at once."""
        errors = [f"unknown parameter {k!r} (takes: {', '.join(sorted(self.types))})"
                  for k in given if k not in self.types]
        out: dict[str, Any] = {}
        for name, ch_type in self.types.items():
            raw = given.get(name, self.defaults.get(name))
            if raw is None:
                errors.append(f"parameter {name} ({ch_type}) needs --param {name}=VALUE")
                continue
            try:
                out[name] = _convert(raw, ch_type)
            except ValueError:
                errors.append(f"parameter {name}: {raw!r} is not a {ch_type}")
        if errors:
            raise ValueError("; ".join(errors))
        return out


def _convert(raw: str, ch_type: str) -> Any:
    base = ch_type.strip()
    if re.match(r"U?Int\d+$", base):
        return int(raw)
    if re.match(r"Float\d+$", base):
        return float(raw)
    return raw


def run_saved(client: Any, q: SavedQuery, given: dict[str, str]) -> tuple[list[str], list[Any]]:
    result = client.query(q.sql, parameters=q.bind(given))
    return list(result.column_names), [list(r) for r in result.result_rows]


def render(columns: list[str], rows: list[list[Any]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([dict(zip(columns, r, strict=True)) for r in rows], default=_text,
                          indent=1)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows([["" if v is None else _text(v) for v in r] for r in rows])
        return buf.getvalue().rstrip("\n")
    cells = [columns] + [["NULL" if v is None else _text(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [f"({len(rows)} rows)"])


def _text(v: Any) -> str:
    if isinstance(v, datetime):
        return v.isoformat(sep=" ", timespec="milliseconds")
    if isinstance(v, date):
        return v.isoformat()
    return str(v)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("query", help="run a saved ClickHouse query (--list to see them)")
    p.add_argument("name", nargs="?", help="saved query name, e.g. hourly_preemptions")
    p.add_argument("--list", action="store_true", help="list saved queries and what they answer")
    p.add_argument("--param", action="append", default=[], metavar="K=V",
                   help="query parameter, repeatable (defaults are in the query's header)")
    p.add_argument("--format", choices=FORMATS, default="table")
    p.add_argument("--dsn", help=f"http(s)://... or chdb:///path [{ENV_DSN}, else the "
                                 f"embedded store under {ENV_DATA_DIR}, as kvscope serve]")
    p.add_argument("--database", help="database (default: the DSN's, else kvscope)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.list or not args.name:
        for f in schema.sql_files("queries"):
            q = SavedQuery.load(f.name[:-4])
            print(f"{q.name}\n    {q.about}\n    parameters: "
                  + (", ".join(f"{k}={q.defaults.get(k, '(required)')}" for k in q.types)
                     or "none"))
        return 0 if args.list else 2
    try:
        q = SavedQuery.load(args.name)
        given = dict(_pair(p) for p in args.param)
        q.bind(given)
    except (KeyError, ValueError) as exc:
        print(f"kvscope query: {exc.args[0]}", file=sys.stderr)
        return 2
    from kvscope.store.sink import Target

    try:
        target = Target.parse(args.dsn or default_dsn())
    except ValueError as exc:
        print(f"kvscope query: {exc}", file=sys.stderr)
        return 2
    try:
        client = _connect(target, args.database or target.database or schema.DEFAULT_DATABASE)
        try:
            columns, rows = run_saved(client, q, given)
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - one clear line, credentials hidden
        print(f"kvscope query: {_explain(exc, target)}", file=sys.stderr)
        return 1
    print(render(columns, rows, args.format))
    return 0


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--param {text!r} must be NAME=VALUE")
    return key.strip(), value


def _connect(target: Any, database: str) -> Any:
    if target.chdb_path and not os.path.isdir(target.chdb_path):
        raise FileNotFoundError(f"no chDB store at {target.chdb_path}")
    return embedded.connect(target.dsn, bool(target.chdb_path), database=database)


def _explain(exc: BaseException, target: Any) -> str:
    text = target.scrub(f"{type(exc).__name__}: {exc}")
    if "Cannot lock file" in text or "already initialized" in text:
        text += (" -- the embedded chDB store is open in another process (a running kvscope"
                 " serve or demo?); query it through a ClickHouse server DSN or stop that"
                 " process")
    if "UNKNOWN_IDENTIFIER" in text or "NO_SUCH_COLUMN_IN_TABLE" in text:
        text = text[:1500] + (
            " -- the store's tables are older than this kvscope (a column it reads is not "
            "there yet): a kvscope serve of this version adds the new columns as it starts "
            "(each an ALTER TABLE ... ADD COLUMN IF NOT EXISTS, printed by kvscope schema)")
    return text[:2000]
