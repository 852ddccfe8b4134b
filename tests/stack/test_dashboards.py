"""kvscope's Grafana dashboards against real data.

- The committed JSON is what ``python -m dashboards.generate`` writes (no drift).
- UIDs, datasource and ``engine`` variables; every alert's ``dashboard_url`` resolves.
- Every PromQL expression parses (promql-parser) and returns data from a real Prometheus
  (with kvscope's rules) scraping a real ``kvscope serve`` fed by vLLM's real scheduler under
  pressure plus the client events kvscope's middleware would send; the few that cannot
  have data here are listed with the reason, and must stay absent.
- Every ClickHouse panel runs on chDB against the rows that same sidecar wrote, with
  template variables and plugin macros replaced, and returns rows; a panel built from a
  saved query returns exactly what ``kvscope query`` returns for the same parameters.
- Every LogQL query parses with Grafana's grammar, and the decision-log fields they read
  are in the lines the sidecar wrote.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit
from zoneinfo import ZoneInfo

import promql_parser
import pytest
import yaml

from alerts.config import Dashboards
from dashboards.clickhouse import MARKER
from dashboards.clickhouse import load as load_saved
from tests.stack.dashquery import (
    Target,
    clickhouse_macros,
    interpolate,
    label_values,
    load,
    panels,
    targets,
    variables,
)
from tests.stack.dashstack import ChWorker, DashStack
from tests.stack.logql import parse_errors
from tests.stack.promstack import REPO, RULE_FILE

CLICKHOUSE = "grafana-clickhouse-datasource"
UIDS = set(vars(Dashboards()).values())
PROM_BUILTINS = {"__rate_interval": "15s", "__range": "5m", "__interval": "5s",
                 "top": "10"}
"""Grafana's builtins, and the fleet dashboard's custom $top at its default."""
NO_GPU = "no GPU here: NVML is absent, so the sidecar exports no kvscope_gpu_* series"
NO_VLLM = ("needs kvscope serve --vllm-url and a real vLLM server (tests/engine checks "
           "kvscope's counts against vLLM's own)")
NO_DATA = {
    "kvscope-blocks / GPU memory / A": NO_GPU,
    "kvscope-blocks / GPU memory / B": NO_GPU,
    "kvscope-blocks / GPU utilization / A": NO_GPU,
    "kvscope-blocks / Reconciliation with vLLM's /metrics / A": NO_VLLM,
    "kvscope-blocks / Reconciliation with vLLM's /metrics / B": NO_VLLM,
    "kvscope-blocks / Reconciliation with vLLM's /metrics / C": NO_VLLM,
    "kvscope-blocks / Scrapes of vLLM's /metrics / A": NO_VLLM,
    "kvscope-blocks / Scrapes of vLLM's /metrics / B": NO_VLLM,
    "kvscope-fleet / Engines whose probe does not record a feature / A": "the twin's vLLM "
    "matches the probe's fingerprint, so no kvscope_probe_feature_disabled series exists "
    "(tests/twin/test_probe_fingerprint.py doctors vLLM to make one)",
    "kvscope-fleet / Engines whose figures differ from vLLM's pool / A": "the audit finds "
    "the ledger equal to vLLM's pool, so no increase is > 0 (tests/twin/test_probe_audit.py "
    "doctors vLLM to make one)",
}


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict[str, Any]]:
    return load()


# -- the JSON itself --------------------------------------------------------------------
def test_committed_json_matches_the_source() -> None:
    done = subprocess.run([sys.executable, "-m", "dashboards.generate", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr


def test_uids_variables_and_datasources(dashboards: dict[str, dict[str, Any]]) -> None:
    assert set(dashboards) == UIDS
    for uid, d in dashboards.items():
        v = variables(d)
        assert v["engine"]["type"] == "query", uid
        assert v["prometheus"]["type"] == "datasource", uid
        ids = [p["id"] for p in panels(d)]
        assert len(ids) == len(set(ids)), f"{uid}: panel IDs repeat"
        for p in panels(d):
            refs = [t["refId"] for t in p.get("targets", [])]
            assert len(refs) == len(set(refs)) and all(refs), (uid, p["title"])
    keys = [t.key for t in targets(dashboards)]
    assert len(keys) == len(set(keys)), [k for k in keys if keys.count(k) > 1]
    kinds = {t.kind for t in targets(dashboards)}
    assert kinds == {"prometheus", "loki", CLICKHOUSE}
    types = {v["query"] for d in dashboards.values() for v in variables(d).values()
             if v["type"] == "datasource"}
    assert types == {"prometheus", "loki", CLICKHOUSE}


def test_every_alert_links_to_a_dashboard_with_its_variables(
        dashboards: dict[str, dict[str, Any]]) -> None:
    rules = [r for g in yaml.safe_load(RULE_FILE.read_text())["groups"] for r in g["rules"]
             if "alert" in r]
    assert rules
    for rule in rules:
        url = urlsplit(rule["annotations"]["dashboard_url"])
        m = re.fullmatch(r"/d/([\w-]+)", url.path)
        assert m and m.group(1) in dashboards, (rule["alert"], url.path)
        for param in parse_qs(url.query):
            assert param.startswith("var-"), (rule["alert"], param)
            assert param[4:] in variables(dashboards[m.group(1)]), (rule["alert"], param)


def test_every_promql_expression_parses(dashboards: dict[str, dict[str, Any]]) -> None:
    exprs = [t for t in targets(dashboards) if t.kind == "prometheus"]
    assert len(exprs) >= 40
    for t in exprs:
        for values in ({"server": "s:1", "engine": "0", "model": "m"},
                       {"server": ".*", "engine": ".*", "model": ".*"}):
            text = interpolate(t.text, {**PROM_BUILTINS, **values, "client": ".*"})
            promql_parser.parse(text)
    for d in dashboards.values():
        for v in variables(d).values():
            if v["type"] == "query":
                selector, _ = label_values(v["query"])
                promql_parser.parse(interpolate(selector, {"server": "s:1", "engine": "0",
                                                           "model": "m"}))


def test_every_logql_query_parses(dashboards: dict[str, dict[str, Any]]) -> None:
    queries = {f"{t.key} [{engine}]": interpolate(t.text, {"server": engine, "engine": engine})
               for t in targets(dashboards) if t.kind == "loki" for engine in ("0", ".*")}
    assert len(queries) >= 16
    assert parse_errors(queries) == {k: [] for k in queries}


def test_clickhouse_panels_are_saved_queries(dashboards: dict[str, dict[str, Any]]) -> None:
    sqls = [t for t in targets(dashboards) if t.kind == CLICKHOUSE]
    assert len(sqls) >= 12
    names = {t.text.split("\n", 1)[0].removeprefix(MARKER) for t in sqls}
    assert all(t.text.startswith(MARKER) for t in sqls)
    assert {"hourly_preemptions", "top_preempted_requests", "layout_heatmap",
            "request_timeline"} <= names
    left = [t.key for t in sqls if re.search(r"(?<!\$)\{\w+:[^{}]+\}", t.text)]
    assert not left, f"{{param:Type}} placeholders left in {left}"


# -- live: Prometheus + sidecar + twin, then chDB ----------------------------------------
class Live:
    """What one run of the stack produced, for the tests below."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.first: dict[str, float] = {}
        """Target key -> seconds after the twin started when it first returned data."""
        self.values: dict[str, str] = {}
        """Concrete variable values (engine, model, server, ...) read from Prometheus."""
        self.variable_values: dict[str, list[str]] = {}
        self.window = (0.0, 0.0)
        self.run: dict[str, Any] = {}


def _watch(stack: DashStack, exprs: list[Target], out: Live) -> None:
    """Poll every expression (variables set to the first engine and model Prometheus knows)
    until each one expected to answer did, and the feeder is done."""
    t0 = time.time()
    expected = [t.key for t in exprs if t.key not in NO_DATA]

    def poll() -> bool:
        if "engine" not in out.values:
            series = 'vllm_scheduler_running_requests{job="kvscope"}'
            servers, engines, models = (stack.label_values(series, x)
                                        for x in ("server", "engine", "model"))
            if not servers or not engines or not models:
                return False
            out.values.update(server=servers[0], engine=engines[0], model=models[0],
                              client=".*")
        vals = {**PROM_BUILTINS, **out.values}
        for t in exprs:
            if t.key not in out.first:
                found = stack.prom.first_sample(interpolate(t.text, vals), t0 - 1.0)
                if found:
                    out.first[t.key] = found[0] - t0
        return bool(stack.done()) and all(k in out.first for k in expected)

    stack.wait("every PromQL panel with data", poll, 150, every_s=0.5,
               report=lambda: f"no data yet: {[k for k in expected if k not in out.first]}")


@pytest.fixture(scope="module")
def live(dashboards: dict[str, dict[str, Any]],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """ONE Prometheus + sidecar + twin feed for the module; stopped before the chDB tests."""
    out = Live(tmp_path_factory.mktemp("dashstack"))
    stack = DashStack(out.tmp)
    try:
        stack.start()
        started = time.time()
        stack.go()
        _watch(stack, [t for t in targets(dashboards) if t.kind == "prometheus"], out)
        out.run = stack.done() or {}
        for d in dashboards.values():
            for name, v in variables(d).items():
                if v["type"] == "query":
                    selector, label = label_values(v["query"])
                    out.variable_values[f"{d['uid']} ${name}"] = stack.label_values(
                        interpolate(selector, out.values), label)
    finally:
        stack.stop()
    out.window = (started, time.time())
    yield out


def test_every_promql_panel_returns_data(live: Live,
                                         dashboards: dict[str, dict[str, Any]]) -> None:
    exprs = {t.key: t for t in targets(dashboards) if t.kind == "prometheus"}
    assert set(NO_DATA) <= set(exprs), "NO_DATA names expressions that do not exist"
    missing = [k for k in exprs if k not in NO_DATA and k not in live.first]
    assert not missing, missing
    present = [k for k in NO_DATA if k in live.first]
    assert not present, f"listed as without data, but answered: {present}"
    assert live.run["preemptions"] > 0 and live.run["client_ends"] > 0, live.run
    print(f"\nfeeder: {live.run}")
    print(f"{len(live.first)} of {len(exprs)} PromQL targets answered; slowest: "
          f"{max(live.first.values()):.1f} s after the twin started")


def test_every_variable_has_values(live: Live) -> None:
    empty = [k for k, v in live.variable_values.items() if not v]
    assert not empty, empty


@pytest.fixture(scope="module")
def chdb(live: Live) -> Iterator[ChWorker]:
    worker = ChWorker(f"chdb://{live.tmp / 'data' / 'chdb'}", "kvscope",
                      live.tmp / "chworker.log")
    yield worker
    worker.close()


def _rows(answer: dict[str, Any], what: str) -> list[list[Any]]:
    assert "error" not in answer, f"{what}: {answer['error']}"
    return list(answer["rows"])


def test_every_clickhouse_panel_answers_on_twin_rows(
        live: Live, chdb: ChWorker, dashboards: dict[str, dict[str, Any]]) -> None:
    sqls = [t for t in targets(dashboards) if t.kind == CLICKHOUSE]
    victim = _rows(chdb.ask(saved="top_preempted_requests",
                            params={"engine": live.values["engine"]}), "victims")
    assert victim, "no preempted request in request_traces"
    concrete = {**live.values, "days": "7", "limit": "20", "block_bucket": "1",
                "kv_group": "-1", "request_id": victim[0][4]}
    start, end = live.window[0] - 60, live.window[1] + 60
    counts: dict[str, int] = {}
    for t in sqls:
        all_vars = variables(dashboards[t.uid])
        variants = [frozenset()]
        if all_vars["engine"].get("includeAll"):
            variants.append(frozenset({"server", "engine", "model"}))
        for all_ in variants:
            vals = {**concrete, **{name: ".*" for name in all_}}
            sql = clickhouse_macros(interpolate(t.text, vals, all_), start, end, 1)
            rows = _rows(chdb.ask(sql=sql), f"{t.key} (All: {sorted(all_)})")
            assert rows, f"{t.key} returned no rows (All: {sorted(all_)})\n{sql}"
            counts[f"{t.key}{' [All]' if all_ else ''}"] = len(rows)
    print("\nrows per ClickHouse panel:\n" + "\n".join(f"  {k}: {n}" for k, n in counts.items()))


def test_clickhouse_panels_answer_as_kvscope_query(
        live: Live, chdb: ChWorker, dashboards: dict[str, dict[str, Any]]) -> None:
    """The panel's SQL (variables and macros replaced) and ``kvscope query NAME --param``
    with the same values return the same table."""
    tz = ZoneInfo(_rows(chdb.ask(sql="SELECT timezone()"), "timezone")[0][0])
    start, end = int(live.window[0] - 60), int(live.window[1] + 60)
    victim = _rows(chdb.ask(saved="top_preempted_requests", params={}), "victims")[0][4]

    def stamp(s: int) -> str:
        return datetime.fromtimestamp(s, tz).strftime("%Y-%m-%d %H:%M:%S.000")

    params = {"days": "7", "limit": "20", "engine": live.values["engine"],
              "server": live.values["server"], "model": live.values["model"],
              "request_id": victim, "block_bucket": "1", "kv_group": "-1",
              "since": stamp(start), "until": stamp(end), "time_bucket_s": "1", "bucket_s": "1"}
    compared = []
    for t in (t for t in targets(dashboards) if t.kind == CLICKHOUSE):
        name = t.text.split("\n", 1)[0].removeprefix(MARKER)
        sql = clickhouse_macros(interpolate(t.text, {**live.values, **params}), start, end, 1)
        panel = chdb.ask(sql=sql)
        saved = chdb.ask(saved=name, params={k: v for k, v in params.items()
                                             if k in load_saved(name).types})
        assert "error" not in saved, (name, saved)
        assert panel == saved, f"{t.key} and kvscope query {name} disagree"
        compared.append(name)
    assert len(set(compared)) >= 12, compared


def test_decision_log_carries_what_the_logql_queries_read(
        live: Live, dashboards: dict[str, dict[str, Any]]) -> None:
    lines = [json.loads(x) for x in (live.tmp / "decisions.jsonl").read_text().splitlines()]
    assert lines, "the sidecar wrote no decision line"
    keys = set().union(*(line.keys() for line in lines))
    events = {line["event"] for line in lines}
    stream_labels = {"job", "engine", "event"}  # loki/config.alloy
    for t in (t for t in targets(dashboards) if t.kind == "loki"):
        fields = set(re.findall(r"\bby \(([^)]*)\)", t.text))
        fields = {f.strip() for group in fields for f in group.split(",")}
        fields |= set(re.findall(r"unwrap (\w+)", t.text))
        fields |= set(re.findall(r"\{\{\.(\w+)\}\}", t.text))
        fields |= set(re.findall(r"\| (\w+) [<>=!]", t.text)) - {"__error__"}
        assert fields <= keys | stream_labels, (t.key, fields - keys - stream_labels)
        for event in re.findall(r'event="(\w+)"', t.text):
            assert event in events, (t.key, event, events)
    assert any("Preempting request" in line["msg"] for line in lines)

