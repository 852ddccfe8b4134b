"""Each metric declared once: the collectors, describe(), the README and /metrics agree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse

from kvscope.metric_table import BY_NAME, COUNTER, GAUGE, METRICS, markdown_table, series
from kvscope.sidecar.exposition.metric_families import EL
from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.sidecar.http.app import create_app
from kvscope.sinks.metrics import SinkCollector
from kvscope.state.hub import Hub
from tests.astparse import parse
from tests.unit.test_hub import feed, keyframe
from tests.unit.test_wire import hello, step

REPO = Path(__file__).resolve().parents[2]
EXPOSITION = REPO / "exporter" / "kvscope" / "sidecar" / "exposition"
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
"""What Prometheus 2.42 (the stack's) sends when it scrapes, captured from a real scrape."""


def test_every_name_is_declared_once() -> None:
    assert len({m.name for m in METRICS}) == len(METRICS)
    assert {m.kind for m in METRICS} == {GAUGE, COUNTER}


def test_readme_metric_table_is_the_generated_one() -> None:
    assert markdown_table() in (REPO / "README.md").read_text()


def test_every_call_site_asks_for_the_declared_type_and_labels() -> None:
    asked = []
    for path in sorted(EXPOSITION.glob("*.py")):
        for node in ast.walk(parse(path)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("g", "c") and node.args
                    and isinstance(node.args[0], ast.Constant)):
                labels = (eval(compile(ast.Expression(node.args[1]), path.name, "eval"),
                               {"EL": EL}) if len(node.args) > 1 else EL)
                kind = GAUGE if node.func.attr == "g" else COUNTER
                asked.append((node.args[0].value, kind, tuple(labels)))
    assert len(asked) > 50
    wrong = [a for a in asked if (BY_NAME[a[0]].kind, BY_NAME[a[0]].labels) != a[1:]]
    assert wrong == []


def test_describe_finds_a_duplicate_at_registration() -> None:
    registry = CollectorRegistry()
    registry.register(KVScopeCollector(Hub()))
    registry.register(SinkCollector([]))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(KVScopeCollector(Hub()))


def _served(hub: Hub, accept: str | None) -> tuple[str, str]:
    registry = CollectorRegistry()
    registry.register(KVScopeCollector(hub))
    c = TestClient(create_app(hub, registry))  # type: ignore[arg-type]
    r = c.get("/metrics", headers={"accept": accept} if accept else {})
    assert r.status_code == 200
    return r.headers["content-type"], r.text


def test_metrics_answers_openmetrics_to_prometheus_and_text_otherwise() -> None:
    hub = Hub()
    feed(hub, [hello(), step(), keyframe()], 0)
    kind, body = _served(hub, PROMETHEUS_ACCEPT)
    assert kind.startswith("application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert body.endswith("# EOF\n")
    om = {f.name: f for f in om_parse(body)}
    assert om["vllm_scheduler_free_blocks"].samples[0].value == 7
    assert om["vllm_scheduler_steps"].type == "counter"
    kind, body = _served(hub, None)  # httpx's */*, as curl's
    assert kind.startswith("text/plain; version=0.0.4")
    text = {f.name: f for f in text_parse(body)}
    assert text["vllm_scheduler_free_blocks"].samples[0].value == 7
    assert set(text) == set(om)


def test_every_series_the_rules_and_dashboards_query_is_declared() -> None:
    """The committed rule file and dashboards (generated through ``series``) name only
    declared series: a renamed metric cannot leave a panel or an alert reading nothing."""
    files = [REPO / "alerts" / "kvscope.rules.yml",
             *sorted((REPO / "dashboards" / "json").rglob("*.json"))]
    names = [m.group(1) for f in files for m in re.finditer(
        r"(?<![\w:./-])((?:kvscope|vllm_scheduler)_[a-z_]+)(?![\w:])", f.read_text())]
    assert len(names) > 100
    undeclared = []
    for name in sorted(set(names)):
        try:
            series(name)
        except KeyError:
            undeclared.append(name)
    assert undeclared == []
    with pytest.raises(KeyError):
        series("vllm_scheduler_free_blocks_total")  # a gauge has no _total
