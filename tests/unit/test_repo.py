"""The README's promises that a script can check."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", text)[:2]


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    demo, tests = readme_commands()
    assert demo.endswith("kvscope demo")
    assert "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command() -> None:
    _, tests = readme_commands()
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines


def test_every_readme_metric_name_is_exported() -> None:
    metrics_src = (ROOT / "exporter/kvscope/sidecar/metrics.py").read_text()
    readme = (ROOT / "README.md").read_text()
    for name in re.findall(r"`((?:vllm_scheduler|kvscope)_[a-z_]+)`", readme):
        base = name.removesuffix("_total")
        assert base in metrics_src or base.rstrip("_") in metrics_src, name
