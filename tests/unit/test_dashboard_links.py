"""What the dashboards' links and the runbook hand an operator.

- Every ``kvscope`` command a link or the runbook shows parses with kvscope's own command
  line, placeholders filled in: a command copied at night from a panel must run, not
  answer with a usage error.
- A request ID put into a URL is percent-encoded there (vLLM takes any ``X-Request-Id``:
  ``/``, ``&``, ``#``, spaces), whatever Grafana's default for data links is (it has
  changed between versions), and so is the Loki data source's derived field."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvscope.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDER = re.compile(r"\$\{[^}]+\}|<[^>]+>")


def _links(node: Any) -> Iterator[tuple[str, str]]:
    """(title, url) of every link under ``node``."""
    if isinstance(node, dict):
        if isinstance(node.get("title"), str) and isinstance(node.get("url"), str):
            yield node["title"], node["url"]
        for v in node.values():
            yield from _links(v)
    elif isinstance(node, list):
        for v in node:
            yield from _links(v)


def shown() -> list[tuple[str, str]]:
    """(where, command) for each link title that is a command and each backquoted
    ``kvscope`` command line of the runbook (line breaks inside one folded)."""
    subcommands = set(_subparsers(build_parser()).choices)
    out = []
    for path in sorted((REPO / "dashboards" / "json").glob("*.json")):
        out += [(path.name, t) for t, _ in _links(json.loads(path.read_text()))
                if t.startswith("kvscope ")]
    runbook = (REPO / "alerts" / "runbook.md").read_text()
    for span in re.findall(r"`([^`]+)`", runbook):
        words = span.split()
        # a span ending in an option names that option in prose ("with `kvscope serve
        # --vllm-url`, ..."), not a command line
        if (len(words) > 1 and words[0] == "kvscope" and words[1] in subcommands
                and not words[-1].startswith("--")):
            out.append(("runbook.md", " ".join(words)))
    return out


def _subparsers(parser: Any) -> Any:
    return next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))


def test_the_commands_are_found() -> None:
    where = {w for w, _ in shown()}
    assert "kvscope-fleet.json" in where and "runbook.md" in where


@pytest.mark.parametrize(("where", "command"), shown())
def test_a_shown_command_parses(where: str, command: str) -> None:
    argv = shlex.split(PLACEHOLDER.sub("x", command))[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: {command!r} is not a kvscope command line (exit {exc.code})")


def test_a_request_id_in_a_url_is_percent_encoded() -> None:
    import yaml

    urls = [u for path in (REPO / "dashboards" / "json").glob("*.json")
            for _, u in _links(json.loads(path.read_text()))]
    sources = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/kvscope.yml").read_text())
    urls += [f["url"] for s in sources["datasources"]
             for f in s.get("jsonData", {}).get("derivedFields", [])]
    carrying = [u for u in urls if "__value.raw" in u]
    assert len(carrying) >= 4  # the timelines' and explain's links, the derived field
    for u in carrying:
        assert re.findall(r"\$\{__value\.raw[^}]*\}", u) == ["${__value.raw:percentencode}"], u
