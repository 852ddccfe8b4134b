"""The committed Grafana dashboards read the way Grafana reads them: panels, targets and
variables; template variables and the ClickHouse plugin's macros replaced as Grafana's
template service and grafana-clickhouse-datasource (pkg/macros/macros.go) replace them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards" / "json"
_VAR = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$", re.DOTALL)


@dataclass(frozen=True)
class Target:
    uid: str
    panel: str
    ref: str
    kind: str
    """prometheus, loki or grafana-clickhouse-datasource (the datasource variable's type)."""
    text: str
    """The PromQL / LogQL expression or the raw SQL."""

    @property
    def key(self) -> str:
        return f"{self.uid} / {self.panel} / {self.ref}"


def load() -> dict[str, dict[str, Any]]:
    """Every committed dashboard by UID."""
    out = {}
    for f in sorted(DASHBOARDS.glob("*.json")):
        d = json.loads(f.read_text())
        out[d["uid"]] = d
    return out


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])


def variables(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash.get("templating", {}).get("list", [])}


def datasource_type(dash: dict[str, Any], ref: dict[str, Any]) -> str:
    """The plugin type behind a datasource reference ``{"uid": "${var}"}``."""
    m = re.fullmatch(r"\$\{(\w+)\}", ref.get("uid", ""))
    var = variables(dash).get(m.group(1)) if m else None
    if var is None or var["type"] != "datasource":
        raise AssertionError(f"{dash['uid']}: datasource {ref} is not a datasource variable")
    if var["query"] != ref.get("type"):
        raise AssertionError(f"{dash['uid']}: {ref} names type {ref.get('type')}, "
                             f"variable ${m.group(1) if m else ''} is {var['query']}")
    return str(var["query"])


def targets(dashboards: dict[str, dict[str, Any]]) -> list[Target]:
    out = []
    for uid, d in dashboards.items():
        for p in panels(d):
            for t in p.get("targets", []):
                kind = datasource_type(d, t.get("datasource") or p["datasource"])
                text = t.get("rawSql") if "rawSql" in t else t.get("expr")
                out.append(Target(uid, p["title"], t["refId"], kind, text))
    return out


def label_values(query: str) -> tuple[str, str]:
    """(series selector, label) of a Prometheus ``label_values(SELECTOR, LABEL)`` query."""
    m = _LABEL_VALUES.match(query.strip())
    if not m:
        raise AssertionError(f"not a label_values() query: {query!r}")
    return m.group(1).strip(), m.group(2)


def interpolate(text: str, values: dict[str, str], all_: frozenset[str] = frozenset()) -> str:
    """Replace ``$name``, ``${name}``, ``${name:format}`` as Grafana does for a single value.

    Names in ``all_`` have All selected: Grafana inserts their custom All value unformatted.
    ``$__``-prefixed names are builtins (``$__rate_interval``) or macros the datasource
    expands: those with a value in ``values`` are replaced, the rest are left alone.
    """

    def sub(m: re.Match[str]) -> str:
        name, fmt = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), None)
        if name not in values:
            if name.startswith("__"):
                return m.group(0)
            raise AssertionError(f"no value for ${name} in {text!r}")
        value = values[name]
        if name in all_ or fmt in (None, "raw"):
            return value
        if fmt == "sqlstring":
            return "'" + value.replace("'", "''") + "'"
        if fmt == "queryparam":
            return f"var-{name}={value}"
        raise AssertionError(f"format {fmt} of ${name} is not handled here")

    return _VAR.sub(sub, text)


def clickhouse_macros(sql: str, start_s: float, end_s: float, interval_s: float) -> str:
    """The plugin's macros (pkg/macros/macros.go) for a time range and interval."""
    f, t = int(start_s), int(end_s)
    fms, tms = int(start_s * 1000), int(end_s * 1000)
    simple = {
        "fromTime_ms": f"fromUnixTimestamp64Milli({fms})",
        "toTime_ms": f"fromUnixTimestamp64Milli({tms})",
        "fromTime": f"toDateTime({f})",
        "toTime": f"toDateTime({t})",
        "interval_s": str(max(int(interval_s), 1)),
    }

    def fn(m: re.Match[str]) -> str:
        name, arg = m.group(1), m.group(2)
        if arg is None:
            if name not in simple:
                raise AssertionError(f"ClickHouse macro $__{name} is not handled here")
            return simple[name]
        if name == "timeFilter":
            return f"{arg} >= toDateTime({f}) AND {arg} <= toDateTime({t})"
        if name == "timeFilter_ms":
            return (f"{arg} >= fromUnixTimestamp64Milli({fms}) AND "
                    f"{arg} <= fromUnixTimestamp64Milli({tms})")
        if name == "timeInterval":
            return (f"toStartOfInterval(toDateTime({arg}), "
                    f"INTERVAL {max(int(interval_s), 1)} second)")
        raise AssertionError(f"ClickHouse macro $__{name}() is not handled here")

    out = re.sub(r"\$__(\w+?)(?:\((\w+)\))?(?=\W|$)", fn, sql)
    if "$" in out:
        raise AssertionError(f"unexpanded $ left in SQL: {out}")
    return out
