"""Suite-wide rule: under ``CI=true`` a skipped (or xfailed) test fails the run.

Unless the README's "Allowed to skip in CI" list names it (its node ID, in backticks)
and says why; a listed test that did not skip is reported too, so the list stays true.
Skips at collection (``pytest.importorskip`` at module level) count like any other.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvscope.localvllm.server import NICE_ENV

pytest_plugins = ["pytester"]

ALLOWED_HEADING = "### Allowed to skip in CI"
_ITEM = re.compile(r"^- `([^`]+)`: (\S.*)$")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def allowed_skips(readme: Path) -> dict[str, str]:
    """Node ID -> reason from the README's list; ValueError when the list is missing or
    an entry lacks a reason."""
    lines = readme.read_text().splitlines()
    if ALLOWED_HEADING not in lines:
        raise ValueError(f"{readme} has no {ALLOWED_HEADING!r} section")
    allowed: dict[str, str] = {}
    for line in lines[lines.index(ALLOWED_HEADING) + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("- "):
            m = _ITEM.match(line)
            if m is None:
                raise ValueError(f"README skip entry without `node id`: reason: {line!r}")
            allowed[m.group(1)] = m.group(2)
    return allowed


class SkipGuard:
    """Collects every skip of the session and judges them at its end (a plugin object:
    reports carry no config)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.skips: dict[str, str] = {}
        self.ran: set[str] = set()
        self.problems: list[str] = []

    def _note(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if not report.skipped:
            return
        why = getattr(report, "wasxfail", None)
        if why is not None:
            why = f"xfail: {why}"
        else:
            longrepr = report.longrepr
            why = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        self.skips.setdefault(report.nodeid, why)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.ran = {item.nodeid for item in session.items}

    def judge(self) -> list[str]:
        try:
            allowed = allowed_skips(self.config.rootpath / "README.md")
        except (OSError, ValueError) as exc:
            return [f"cannot read the allowed skips: {exc}"]
        out = [f"{nodeid} skipped ({why}) and the README does not allow it"
               for nodeid, why in self.skips.items() if nodeid not in allowed]
        out += [f"{nodeid} is allowed to skip in the README but ran: remove it from the list"
                for nodeid in allowed if nodeid in self.ran and nodeid not in self.skips]
        return out

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not in_ci():
            return
        self.problems = self.judge()
        if self.problems and session.exitstatus in (pytest.ExitCode.OK,
                                                    pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.problems:
            terminalreporter.section("skips not allowed in CI (CI=true)", red=True)
            for line in self.problems:
                terminalreporter.line(line, red=True)


LATE_PLUGIN_IMPORTS = ("hypothesis.internal.observability", "schemathesis.reporting.allure")
"""Modules two plugins import only as the session ends. pytest rewrites a plugin's modules
with ``ast.parse``, and CPython 3.11.7 can fail that parse with ``SystemError: AST
constructor recursion depth mismatch`` once tests have run threads (python/cpython#106905,
tests/astparse.py): seen at the terminal summary of a run whose tests had all passed.
Imported here, at configure time, before any test starts a thread."""


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipGuard(config), "kvscope-skip-guard")
    for name in LATE_PLUGIN_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


SUITE_VLLM_NICE = 10
"""The niceness of every vLLM server the tests start (``KVSCOPE_VLLM_NICE``, read by
``kvscope.localvllm.server``). vLLM on the CPU binds its worker to one core and keeps the
other for its EngineCore: while the engine tests generate, it takes most of this 2-core
machine, and the other xdist worker's multi-process tests starved beside it (CI on 936e5f8:
eight twin engines' 2 s heartbeats went past a 4 s health timeout; a twin feeder, ~21 s of
steps alone, had not finished in 120 s). Measured with eight idle twin engines polled for
40 s beside tests/engine/shared: the longest silence 3.3 s against 2.0-2.4 alone, 2.6 with
vLLM niced. Niced, vLLM yields to them and runs at full speed otherwise."""
os.environ[NICE_ENV] = str(SUITE_VLLM_NICE)

ENGINE_TESTS = "tests/engine/"
"""Where every test marked ``engine`` (a real vLLM server) lives: ``xdist_group`` below
groups them by this path, so it is checked at collection."""


def xdist_group(nodeid: str) -> str:
    """The unit of work of the README's ``pytest -n 2 --dist loadgroup``: every engine test
    in one group, so one worker runs them in turn (their machine-wide vLLM lock would make
    them wait anyway, and the shared server package starts its server once); every other
    module a group of its own (its fixtures start once)."""
    path = nodeid.split("::", 1)[0]
    return "vllm-server" if path.startswith(ENGINE_TESTS) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` by ``xdist_group``. pytest-xdist's own reads ``xdist_group``
    marks by renaming each test's node ID, which pytest 9 no longer lets it do: every test
    was then its own unit (modules' fixtures set up on both workers, engine tests waiting
    on each other's vLLM lock on both). Other ``--dist`` modes stay xdist's."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test marked ``engine`` must live under ``ENGINE_TESTS`` (``xdist_group``)."""
    stray = [item.nodeid for item in items if item.get_closest_marker("engine") is not None
             and not item.nodeid.startswith(ENGINE_TESTS)]
    if stray:
        raise pytest.UsageError(f"tests marked engine outside {ENGINE_TESTS}: {stray}")
