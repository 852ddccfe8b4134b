"""kvscope's rule file: generated from alerts/ without drift, valid for promtool, every alert
unit-tested by promtool (firing and silent cases) and documented in the runbook."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields

import pytest
import yaml

from alerts.config import Config, Dashboards
from alerts.rules import build
from kvscope.settings import SETTINGS
from tests.stack.promstack import REPO, RULE_FILE, binary, load_rules, rule_key

ALERT_TESTS = sorted((REPO / "alerts" / "tests").glob("*.yml"))
RUNBOOK = REPO / "alerts" / "runbook.md"


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_rule_file_is_generated_from_its_source() -> None:
    done = run([sys.executable, "-m", "alerts.generate", "--check"])
    assert done.returncode == 0, done.stdout + done.stderr


def test_rule_file_loads_back_as_the_source_built_it() -> None:
    # Folded YAML text must not change a single character of an annotation.
    assert yaml.safe_load(RULE_FILE.read_text()) == build()


def test_promtool_checks_the_rule_file() -> None:
    done = run([binary("promtool"), "check", "rules", str(RULE_FILE)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_pass() -> None:
    assert ALERT_TESTS
    done = run([binary("promtool"), "test", "rules", *map(str, ALERT_TESTS)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(ALERT_TESTS), done.stdout


def test_every_alert_rule_is_unit_tested_with_its_annotations() -> None:
    """Each alert rule (name and severity) fires in some promtool case with every
    annotation checked; the engines of that case that must stay silent are the others."""
    tested: set[str] = set()
    for path in ALERT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for art in case.get("alert_rule_test", []):
                for exp in art.get("exp_alerts") or []:
                    assert set(exp.get("exp_annotations", {})) == {
                        "summary", "description", "runbook_url", "dashboard_url"
                    }, f"{path.name}: {art['alertname']} without all annotations checked"
                    tested.add(f"{art['alertname']}[{exp['exp_labels']['severity']}]")
    alerts = {rule_key(r) for r in load_rules() if "alert" in r}
    assert alerts - tested == set(), "alert rules no promtool test fires"
    assert tested - alerts == set(), "promtool tests of alerts that do not exist"


def test_every_alert_follows_the_conventions() -> None:
    cfg = Config()
    uids = {getattr(cfg.dashboards, f.name) for f in fields(Dashboards)}
    runbook = RUNBOOK.read_text()
    sections = set(re.findall(r"^## (\S+)$", runbook, flags=re.MULTILINE))
    for rule in load_rules():
        if "record" in rule:
            assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
            continue
        name, labels, ann = rule["alert"], rule["labels"], rule["annotations"]
        assert re.fullmatch(r"KVScope(?:[A-Z][a-z]*|KV)+", name), name
        assert labels["severity"] in ("critical", "warning", "info"), name
        assert labels["priority"] == cfg.priority(labels["severity"]), name
        assert set(ann) == {"summary", "description", "runbook_url", "dashboard_url"}, name
        assert "{{" not in ann["summary"] and ann["summary"].endswith("."), name
        assert "{{ $labels." in ann["description"], name
        assert ann["runbook_url"] == f"{cfg.runbook_url}#{name.lower()}", name
        assert name in sections, f"alerts/runbook.md has no '## {name}' section"
        uid = ann["dashboard_url"].split("/d/", 1)[1].split("?", 1)[0]
        assert ann["dashboard_url"].startswith(cfg.grafana_url) and uid in uids, name
    alerts = {r["alert"] for r in load_rules() if "alert" in r}
    assert sections == alerts, "runbook sections without an alert"


def vllm_flags() -> set[str]:
    """Every option of vLLM's own server parser (``EngineArgs.add_cli_args``)."""
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # where older vLLMs keep it
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return set(parser._option_string_actions)


def test_runbook_names_only_real_vllm_flags() -> None:
    real = vllm_flags() | {
        "--health-timeout", "--endpoint", "--vllm-url",
        "--param", "--list",
        "--worst", "--since", "--server",  # kvscope explain's, as --param is kvscope query's
    } | {s.flag for s in SETTINGS if s.flag}  # kvscope serve's
    texts = [RUNBOOK.read_text()] + [
        r["annotations"]["description"] for r in load_rules() if "alert" in r
    ]
    named = {flag for text in texts for flag in re.findall(r"--[a-z][a-z-]+", text)}
    assert named <= real, f"flags that are neither vLLM's nor kvscope's: {named - real}"


def test_config_changes_reach_every_rule() -> None:
    cfg = Config(
        selector='job="kv", namespace="llm"',
        grafana_url="https://grafana.example.org",
        contiguity_severity="warning",
        budget_left_below=0.3,
    )
    rules = {rule_key(r): r for g in build(cfg)["groups"] for r in g["rules"]}
    contiguity = rules["KVScopeContiguousFreeBlocksLow[warning]"]
    assert contiguity["labels"] == {"severity": "warning", "priority": "P2"}
    assert "< 0.3" in rules["KVScopeKVPoolExhaustedBudgetLeft[critical]"]["expr"]
    for rule in rules.values():
        assert 'job="kvscope"' not in rule["expr"]
        if "alert" in rule:
            assert rule["annotations"]["dashboard_url"].startswith("https://grafana.example.org/d/")
    assert 'up{job="kv", namespace="llm"} == 0' == rules["KVScopeSidecarDown[warning]"]["expr"]


def test_config_reports_every_error_at_once() -> None:
    cfg = Config(exhausted_for="5 minutes", budget_left_below=2.0,
                 contiguity_severity="page", preemption_rate_critical=0.01)  # type: ignore[arg-type]
    errors = cfg.validate()
    assert len(errors) == 4, errors
    with pytest.raises(ValueError, match="exhausted_for"):
        build(cfg)


def test_every_p1_alert_runbook_names_the_explain_command() -> None:
    """Each P1 (critical) alert's section names the ``kvscope explain --worst`` command
    that lists the requests behind it, scoped to the alert's server."""
    runbook = RUNBOOK.read_text()
    p1 = {r["alert"] for r in load_rules() if "alert" in r and r["labels"]["priority"] == "P1"}
    assert p1 >= {"KVScopeKVPoolExhaustedBudgetLeft", "KVScopePreemptionRateHigh"}
    for name in p1:
        section = runbook.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "kvscope explain --worst 10 --since 900 --server <server>" in section, name
