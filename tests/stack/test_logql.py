"""Every saved LogQL query parses with Grafana's own LogQL grammar."""

from __future__ import annotations

from kvscope.decisions.logql import read_queries
from tests.stack.logql import ROOT, parse_errors


def test_every_saved_logql_query_parses() -> None:
    queries = read_queries(ROOT / "loki" / "queries.logql")
    assert len(queries) >= 6
    assert all(q.doc for q in queries), "every query says what it answers"
    names = {q.name for q in queries}
    assert {"preemptions_by_reason", "top_victims", "admissions_blocked"} <= names
    errors = parse_errors({q.name: q.query for q in queries})
    assert errors == {q.name: [] for q in queries}


def test_the_checker_does_find_errors() -> None:
    errors = parse_errors({"broken": 'sum by (x (count_over_time({job="k"} [5m])'})
    assert errors["broken"]
