"""The CI rule in tests/conftest.py, run on small suites by a real pytest (pytester)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ALLOWED_HEADING, allowed_skips
from tests.unit.test_repo import ROOT

SUITE = """
import pytest

def test_runs():
    assert True

def test_skips():
    pytest.skip("no GPU here")

@pytest.mark.xfail(reason="known bug")
def test_fails_expectedly():
    assert False
"""


def run(pytester: pytest.Pytester, allowed: list[str], *, ci: str | None = "true",
        suite: str = SUITE) -> pytest.RunResult:
    pytester.makeconftest("from tests.conftest import pytest_configure  # noqa: F401\n")
    pytester.makefile(".md", README="# x\n\n" + ALLOWED_HEADING + "\n\n"
                      + "".join(f"{line}\n" for line in allowed) + "\n## Next\n")
    pytester.makepyfile(test_suite=suite)
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))  # `tests` importable
    if ci is None:
        mp.delenv("CI", raising=False)
    else:
        mp.setenv("CI", ci)
    try:
        # In a process of its own: in this worker's process, loading the plugins again can
        # hit CPython 3.11.7's AST depth bug (tests/astparse.py; CI: "Error while loading
        # plugin", INTERNAL_ERROR).
        return pytester.runpytest_subprocess("-p", "no:cacheprovider")
    finally:
        mp.undo()


def test_under_ci_a_skip_or_xfail_the_readme_does_not_name_fails_the_run(
        pytester: pytest.Pytester) -> None:
    result = run(pytester, [])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*test_suite.py::test_skips skipped (Skipped: no GPU here) and the README does not*",
        "*test_suite.py::test_fails_expectedly skipped (xfail: known bug) and the README*"])
    result.assert_outcomes(passed=1, skipped=1, xfailed=1)


def test_named_with_a_reason_they_pass(pytester: pytest.Pytester) -> None:
    result = run(pytester, ["- `test_suite.py::test_skips`: needs a GPU, CI has none",
                            "- `test_suite.py::test_fails_expectedly`: upstream bug #1"])
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()


def test_outside_ci_skips_are_only_reported(pytester: pytest.Pytester) -> None:
    assert run(pytester, [], ci=None).ret == pytest.ExitCode.OK
    assert run(pytester, [], ci="false").ret == pytest.ExitCode.OK


def test_a_module_skipped_at_collection_counts(pytester: pytest.Pytester) -> None:
    suite = "import pytest\npytest.importorskip('no_such_module_kvscope')\n"
    result = run(pytester, [], suite=suite)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_suite.py skipped (*no_such_module_kvscope*"])


def test_a_listed_test_that_ran_or_an_entry_without_a_reason_fails(
        pytester: pytest.Pytester) -> None:
    result = run(pytester, ["- `test_suite.py::test_skips`: no GPU",
                            "- `test_suite.py::test_fails_expectedly`: bug",
                            "- `test_suite.py::test_runs`: flaky"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*test_runs is allowed to skip in the README but ran*"])
    result = run(pytester, ["- `test_suite.py::test_skips`"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*cannot read the allowed skips*without*reason*"])


def test_the_readme_names_each_allowed_skip_with_its_reason() -> None:
    allowed = allowed_skips(ROOT / "README.md")
    assert all("::" in nodeid and why.strip() for nodeid, why in allowed.items())
