"""Each command is one module: its add_parser sets ``run``, and main dispatches on it alone."""

from __future__ import annotations

import argparse

import pytest

from kvscope.cli import COMMANDS, build_parser, main


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_sets_its_own_run() -> None:
    commands = _subparsers(build_parser())
    assert sorted(commands) == ["demo", "explain", "layout", "loadgen", "query", "schema",
                                "serve", "whatif"]
    runs = {p.get_default("run") for p in commands.values()}
    runs |= {p.get_default("run") for p in _subparsers(commands["layout"]).values()}
    runs.discard(None)  # ``layout`` itself; ``layout dump`` runs
    assert runs == {c.run for c in COMMANDS}


def test_serve_reports_every_bad_setting_and_exits_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVSCOPE_PORT", "http")
    monkeypatch.setenv("KVSCOPE_LAYOUT_INTERVAL_S", "often")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err == (
        "kvscope serve: invalid configuration:\n"
        "  - port (KVSCOPE_PORT): cannot read 'http'\n"
        "  - layout_interval_s (KVSCOPE_LAYOUT_INTERVAL_S): cannot read 'often'\n")


@pytest.mark.parametrize("n", ["-1", "0"])
def test_explain_worst_below_one_is_bad_usage_not_a_store_failure(
        n: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--worst -1`` went to the store (ClickHouse refuses a negative LIMIT) and exited 1,
    "the store failed"; README: 2 is bad usage. Said before any store is opened (none
    listens at this address)."""
    assert main(["explain", "--worst", n, "--dsn", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err == "kvscope explain: --worst takes a count of 1 or more\n"
