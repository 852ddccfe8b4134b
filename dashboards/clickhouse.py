"""ClickHouse panels: the plugin's query model, and SQL rendered from saved query files.

A panel's SQL is a saved query (``clickhouse/queries/NAME.sql``, the files ``kvscope query``
runs, or ``dashboards/queries/NAME.sql`` in the same format) with each ``{param:Type}``
placeholder replaced by a Grafana variable or macro, so the panel and ``kvscope query
NAME --param ...`` answer the same question. The first line of the rendered SQL names the
source (``-- kvscope saved query: NAME``); the tests run both on the same rows.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from dashboards.config import CLICKHOUSE_PLUGIN_VERSION, CLICKHOUSE_TYPE
from kvscope.store import schema
from kvscope.store.query import SavedQuery

LOCAL_QUERIES = Path(__file__).resolve().parent / "queries"
"""Saved queries only the dashboards use so far (same format as clickhouse/queries)."""
MARKER = "-- kvscope saved query: "
_PARAM = re.compile(r"\{(\w+):([^{}]+)\}")

DATASOURCE = DataSourceRef(type_val=CLICKHOUSE_TYPE, uid="${clickhouse}")


def all_or(var: str) -> str:
    """A variable whose All value is ``.*`` as a saved query's ``''`` (= any)."""
    return f"if('${{{var}}}' = '.*', '', '${{{var}}}')"


COMMON: dict[str, str] = {
    "days": "${days}",
    "model": all_or("model"),
    "engine": all_or("engine"),
    "server": all_or("server"),
    "limit": "${limit}",
    "since": "$__fromTime_ms",
    "until": "$__toTime_ms",
    "time_bucket_s": "$__interval_s",
    "request_id": "${request_id:sqlstring}",
}
"""How a placeholder becomes Grafana text, unless a panel says otherwise."""


def load(name: str) -> SavedQuery:
    """A saved query by name: kvscope's own first, then the dashboards' local ones."""
    local = LOCAL_QUERIES / f"{name}.sql"
    if local.exists():
        if any(f.name == f"{name}.sql" for f in schema.sql_files("queries")):
            raise ValueError(f"{name}.sql exists in both clickhouse/queries and {LOCAL_QUERIES}")
        return parse(name, local.read_text(encoding="utf-8"))
    return SavedQuery.load(name)


def parse(name: str, sql: str) -> SavedQuery:
    """As ``SavedQuery.load`` reads a file: leading comment, ``@param`` defaults, types."""
    return SavedQuery.parse(name, sql)


def body(sql: str) -> str:
    """The statement without the file's leading comment block."""
    lines = sql.splitlines()
    while lines and (lines[0].startswith("--") or not lines[0].strip()):
        lines.pop(0)
    return "\n".join(lines).strip()


def render(name: str, **values: str) -> str:
    """The saved query ``name`` with every placeholder replaced (``COMMON`` unless given)."""
    q = load(name)
    given = {**{k: v for k, v in COMMON.items() if k in q.types}, **values}
    missing = sorted(set(q.types) - set(given))
    extra = sorted(set(values) - set(q.types))
    if missing or extra:
        raise ValueError(f"saved query {name}: no value for {missing}, unknown {extra}")
    text = _PARAM.sub(lambda m: given[m.group(1)], body(q.sql))
    return f"{MARKER}{name}\n{text}"


class ClickHouseQuery(cogvariants.Dataquery):
    """A target of grafana-clickhouse-datasource v4 in SQL editor mode."""

    def __init__(self, raw_sql: str = "", ref_id: str = "A", time_series: bool = False,
                 datasource: DataSourceRef = DATASOURCE) -> None:
        self.raw_sql = raw_sql
        self.ref_id = ref_id
        self.time_series = time_series
        self.datasource = datasource

    def to_json(self) -> dict[str, object]:
        return {
            "datasource": self.datasource,
            "editorType": "sql",
            # sqlutil.FormatQueryOption: 0 time series, 1 table.
            "format": 0 if self.time_series else 1,
            "pluginVersion": CLICKHOUSE_PLUGIN_VERSION,
            "queryType": "timeseries" if self.time_series else "table",
            "rawSql": self.raw_sql,
            "refId": self.ref_id,
        }


class ClickHouse(cogbuilder.Builder[ClickHouseQuery]):
    def __init__(self, raw_sql: str) -> None:
        self._internal = ClickHouseQuery(raw_sql)

    def build(self) -> ClickHouseQuery:
        return self._internal

    def ref_id(self, ref_id: str) -> typing.Self:
        self._internal.ref_id = ref_id
        return self

    def time_series(self) -> typing.Self:
        self._internal.time_series = True
        return self
