"""kvscope's rules against live data: a real Prometheus scrapes a real ``kvscope serve`` fed
by the twin (vLLM's real scheduler with the probe) under pressure, with
``alerts/kvscope.rules.yml`` loaded. Every rule's expression must return data at some
point, except the ones listed below with the reason they cannot; a copy of the P1 alert with
a 2 s ``for`` must reach a webhook through a real Alertmanager. The sidecar runs with its
default sinks (decision log, embedded chDB store) in a temporary data directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kvscope.localvllm.server import free_port
from tests.stack.promstack import (
    FEED_SERVER,
    HEALTH_TIMEOUT_S,
    REPO,
    RULE_FILE,
    Proc,
    Prometheus,
    Webhook,
    binary,
    load_rules,
    ready,
    rule_key,
    selectors,
    send_foreign_frame,
    wait_for,
)

P1 = "KVScopeKVPoolExhaustedBudgetLeft"
SIDECAR_DOWN = "KVScopeSidecarDown[warning]"
QUIET = {
    # A healthy run must not trigger these; the series they read must exist.
    "KVScopeProbeRecordsDropped[warning]": "the sidecar keeps up, so the probe drops nothing",
    "KVScopeProbeFaults[warning]": "the probe raises nothing inside vLLM's scheduler",
    "KVScopeLedgerStale[warning]": "no record is lost, so the ledger never goes stale",
    "KVScopeLedgerMismatch[warning]": "the ledger equals vLLM's pool at every step",
    "KVScopeAuditMismatch[warning]": "the audit reads vLLM's own pool and finds the ledger "
    "equal to it",
    "KVScopeSinkWriteErrors[warning]": "the embedded chDB store accepts every batch",
    "KVScopeSinkSpoolGrowing[warning]": "nothing is spooled while the store accepts batches",
    "KVScopeSinkRowsDropped[warning]": "the store accepts every batch and the spool never "
    "fills, so no row is dropped",
    "KVScopeSidecarCPUHigh[warning]": "one engine costs the sidecar about a twentieth of a "
    "core, a tenth of the threshold",
    "KVScopeRequestNeverFits[critical]": "every request fits the pool: vLLM (and the twin) "
    "refuse to start a pool that cannot hold one max_model_len request",
}
ABSENT = {
    # The series these read cannot exist in this test; they must stay absent, so that a
    # change (a GPU, a vLLM server to reconcile with) fails here until the rule is live.
    "instance_gpu:kvscope_gpu_memory_used:ratio": "no GPU: NVML is absent, so the sidecar "
    "exports no kvscope_gpu_* series",
    "KVScopeReconciliationDrift[warning]": "needs kvscope serve --vllm-url and a real vLLM "
    "server (tests/engine checks the difference itself)",
    "KVScopeProbeFeatureDisabled[warning]": "the twin's vLLM matches the probe's fingerprint, "
    "so no kvscope_probe_feature_disabled series exists (tests/twin/test_probe_fingerprint.py "
    "and tests/unit/test_probe_disabled.py doctor vLLM to make one)",
}
MARGINS = {
    # How far the run went past the thresholds the live expressions need (for the report).
    "max budget gauge (contiguity rule: > 0.6)":
        'max_over_time(vllm_scheduler_token_budget_utilization{job="kvscope"}[5m])',
    "scrapes with free <= 5% (P1)":
        'sum_over_time((engine:vllm_scheduler_free_blocks:ratio <= bool 0.05)[5m:1s])',
    "scrapes in all": 'count_over_time(vllm_scheduler_free_blocks{job="kvscope"}[5m])',
}


class Stack:
    """Alertmanager, Prometheus, ``kvscope serve`` and the twin feeder, on free ports."""

    def __init__(self, tmp: Path, webhook: Webhook) -> None:
        self.tmp = tmp
        self.webhook = webhook
        self.ports = {"am": free_port(), "prom": free_port(), "sidecar": free_port()}
        self.endpoint = f"ipc://{tmp}/probe.sock"
        self.prom = Prometheus(f"http://127.0.0.1:{self.ports['prom']}")
        self.procs: list[Proc] = []

    def write_configs(self) -> tuple[Path, Path]:
        """Prometheus (scrape 1 s, the rules plus a P1 copy with for: 2s) and Alertmanager;
        both checked by promtool / amtool."""
        p1 = next(r for r in load_rules() if r.get("alert") == P1)
        copy = {**p1, "for": "2s", "labels": {**p1["labels"], "kvscope_test": "live-copy"}}
        copy_file = self.tmp / "p1-live-copy.rules.yml"
        copy_file.write_text(yaml.safe_dump({"groups": [{"name": "live", "rules": [copy]}]}))
        target = {"targets": [f"127.0.0.1:{self.ports['sidecar']}"]}
        prom = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(RULE_FILE), str(copy_file)],
            "alerting": {"alertmanagers": [
                {"static_configs": [{"targets": [f"127.0.0.1:{self.ports['am']}"]}]}]},
            "scrape_configs": [{"job_name": "kvscope", "static_configs": [target]}],
        }
        am = {
            "route": {"receiver": "webhook", "group_by": ["alertname", "engine"],
                      "group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "webhook", "webhook_configs": [
                {"url": self.webhook.url, "send_resolved": False}]}],
        }
        files = (self.tmp / "prometheus.yml", self.tmp / "alertmanager.yml")
        files[0].write_text(yaml.safe_dump(prom))
        files[1].write_text(yaml.safe_dump(am))
        for cmd in ([binary("promtool"), "check", "config", str(files[0])],
                    [binary("amtool"), "check-config", str(files[1])]):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{cmd}: {done.stdout}{done.stderr}"
        return files

    def start(self) -> None:
        prom_cfg, am_cfg = self.write_configs()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1"}
        t, p = self.tmp, self.ports
        self._start("twin feeder", [sys.executable, "-m", "tests.stack.promstack", "feed",
                                    self.endpoint], cwd=REPO, stdin=subprocess.PIPE,
                    env={**env, "KVSCOPE_SERVER": FEED_SERVER})
        self._start("kvscope serve", [
            sys.executable, "-m", "kvscope", "serve", "--endpoint", self.endpoint,
            "--port", str(p["sidecar"]), "--health-timeout", str(HEALTH_TIMEOUT_S),
            "--log-level", "warning",
            "--data-dir", str(t / "data"), "--decision-log", str(t / "decisions.jsonl"),
        ], env=env)
        self._start("alertmanager", [
            binary("prometheus-alertmanager"), f"--config.file={am_cfg}",
            f"--storage.path={t / 'am'}", f"--web.listen-address=127.0.0.1:{p['am']}",
            "--cluster.listen-address=",
        ])
        self._start("prometheus", [
            binary("prometheus"), f"--config.file={prom_cfg}",
            f"--storage.tsdb.path={t / 'tsdb'}", f"--web.listen-address=127.0.0.1:{p['prom']}",
        ])
        self.wait("Alertmanager ready", lambda: ready(f"http://127.0.0.1:{p['am']}"), 30)
        self.wait("Prometheus ready", lambda: ready(self.prom.base), 30)
        # The sidecar opens its embedded chDB store before it serves HTTP: allow for that.
        self.wait("Prometheus scraping the sidecar",
                  lambda: self.prom.query('up{job="kvscope"} == 1'), 90)
        self.wait("the twin feeder to import vLLM", lambda: self.feeder_line("READY"), 120)

    def _start(self, name: str, cmd: list[str], **kw: Any) -> None:
        log = self.tmp / (name.replace(" ", "-") + ".log")
        self.procs.append(Proc(name, cmd, log, **kw))

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def feeder_line(self, word: str) -> str | None:
        """The feeder's line starting with ``word``; fails when the feeder died without it."""
        feeder = self.proc("twin feeder")
        for line in feeder.log.read_text(errors="replace").splitlines():
            if line.startswith(word):
                return line
        if not feeder.alive():
            raise AssertionError(f"the twin feeder exited before {word}\n{feeder.tail()}")
        return None

    def go(self) -> None:
        """Start the twin's run; and push one frame of another wire version."""
        stdin = self.proc("twin feeder").popen.stdin
        assert stdin is not None
        stdin.write(b"go\n")
        stdin.flush()
        send_foreign_frame(self.endpoint)

    def wait(self, what: str, check: Any, timeout_s: float, every_s: float = 0.2,
             report: Any = None) -> None:
        """wait_for, failing at once with the log of a server that died meanwhile."""

        def step() -> Any:
            for p in self.procs:
                if p.name != "twin feeder" and not p.alive():
                    raise AssertionError(f"{p.name} exited while waiting for {what}")
            return check()

        try:
            wait_for(what, step, timeout_s, every_s)
        except AssertionError as exc:
            extra = report() if report else ""
            tails = "\n".join(p.tail(15) for p in self.procs)
            raise AssertionError(f"{exc}\n{extra}\n{tails}") from None

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


class Watch:
    """Keeps, for each expression, the first instant since the watch began at which it
    returned data (Prometheus.first_sample: over the whole span, so a condition that held for
    a few scrapes is found however late a poll round runs; an instant query at poll time
    missed the burst's busy-budget scrapes when the first round ran late under load)."""

    def __init__(self, prom: Prometheus, exprs: list[str]) -> None:
        self.prom = prom
        self.exprs = exprs
        self.first: dict[str, tuple[float, dict[str, Any]]] = {}
        self.t0 = time.monotonic()
        self.t0_unix = time.time()

    def poll(self) -> None:
        for expr in self.exprs:
            if expr not in self.first:
                found = self.prom.first_sample(expr, self.t0_unix - 1.0)
                if found:
                    ts, value, metric = found
                    self.first[expr] = (ts - self.t0_unix, {"metric": metric,
                                                             "value": [ts, value]})

    def seen(self, expr: str) -> bool:
        return expr in self.first


def p1_delivered(webhook: Webhook) -> dict[str, Any] | None:
    return next((a for a in webhook.alerts() if a["labels"].get("alertname") == P1
                 and a["labels"].get("kvscope_test") == "live-copy"), None)


def run_and_watch(
    stack: Stack, rules: dict[str, Any], fires: list[str]
) -> tuple[Watch, dict[str, Any]]:
    """Drive the twin; poll every expression until each live one returned data and the P1
    reached the webhook; then stop the sidecar and wait for ``up == 0``."""
    exprs = [r["expr"] for r in rules.values()]
    for k in (*QUIET, *ABSENT):
        exprs += [s for s in selectors(rules[k]["expr"]) if s not in exprs]
    stack.go()
    watch = Watch(stack.prom, exprs)
    live = [rules[k]["expr"] for k in fires if k != SIDECAR_DOWN]
    delivered: list[float] = []

    def all_live() -> bool:
        watch.poll()
        if not delivered and p1_delivered(stack.webhook):
            delivered.append(time.monotonic() - watch.t0)
        return bool(stack.feeder_line("DONE") and delivered and all(map(watch.seen, live)))

    stack.wait("every live expression and the P1 at the webhook", all_live, 120, every_s=0.5,
               report=lambda: f"no data yet: {missing(watch, rules, fires)}")
    run = json.loads((stack.feeder_line("DONE") or "DONE {}")[5:])
    unhealthy = [(r["name"], r.get("lastError")) for r in stack.prom.rules()
                 if r["health"] != "ok"]
    assert not unhealthy, f"rules Prometheus failed to evaluate: {unhealthy}"
    run["p1_webhook_s"] = round(delivered[0], 1)
    run["margins"] = {name: stack.prom.query(q)[0]["value"][1] for name, q in MARGINS.items()}
    stack.proc("kvscope serve").stop()
    down = rules[SIDECAR_DOWN]["expr"]
    wait_for("up == 0 once the sidecar is gone", lambda: watch.poll() or watch.seen(down), 20,
             every_s=0.5)
    return watch, run


def missing(watch: Watch, rules: dict[str, Any], fires: list[str]) -> list[str]:
    return [k for k in fires if not watch.seen(rules[k]["expr"])]


def test_every_rule_answers_live_and_the_p1_reaches_alertmanager(tmp_path: Path) -> None:
    rules = {rule_key(r): r for r in load_rules()}
    assert set(QUIET) | set(ABSENT) <= set(rules), "QUIET / ABSENT name rules that do not exist"
    fires = [k for k in rules if k not in QUIET and k not in ABSENT]
    webhook = Webhook()
    stack = Stack(tmp_path, webhook)
    try:
        stack.start()
        watch, run = run_and_watch(stack, rules, fires)
    finally:
        stack.stop()
        webhook.close()

    assert run["running"] + run["waiting"] > 0, "the twin must stop with work pending"
    assert not missing(watch, rules, fires)
    for key, why in QUIET.items():
        assert not watch.seen(rules[key]["expr"]), f"{key} fired in a healthy run ({why})"
        for sel in selectors(rules[key]["expr"]):
            assert watch.seen(sel), f"{key} reads {sel}, which never had data"
    for key, why in ABSENT.items():
        present = [s for s in selectors(rules[key]["expr"]) if watch.seen(s)]
        assert not present, f"{key} is listed as without data ({why}), but {present} exist"
        assert not watch.seen(rules[key]["expr"]), key

    alert = p1_delivered(webhook)
    assert alert is not None and alert["status"] == "firing"
    labels, ann = alert["labels"], alert["annotations"]
    assert (labels["severity"], labels["priority"], labels["engine"]) == ("critical", "P1", "0")
    assert re.fullmatch(rf"Engine {FEED_SERVER}/0 \(\S+\) preempted requests .* while only "
                        r"[0-9.]+% of its token budget was used\. .*", ann["description"]), \
        ann["description"]
    assert ann["runbook_url"].endswith("/alerts/runbook.md#kvscopekvpoolexhaustedbudgetleft")
    assert ann["dashboard_url"].endswith(
        f"/d/kvscope-blocks?var-server={FEED_SERVER}&var-engine=0")
    print(report(watch, rules, run))


def report(watch: Watch, rules: dict[str, Any], run: dict[str, Any]) -> str:
    lines = [f"twin run: {run}", "first data per rule (seconds after the twin started):"]
    for key, rule in rules.items():
        if key in ABSENT:
            lines.append(f"  {key:58s} no data by design: {ABSENT[key]}")
        elif key in QUIET:
            lines.append(f"  {key:58s} silent, as it should be: {QUIET[key]}")
        else:
            t, sample = watch.first[rule["expr"]]
            lines.append(f"  {key:58s} {t:5.1f} s  value {sample['value'][1]}")
    return "\n".join(lines)
