"""kvscope's queries at fleet size on a real Prometheus (the Debian 2.42 build).

    python benchmarks/fleet_prometheus.py --exposition SCRAPE [--engines 1000] [--hours 6]

1. Synthesize ``--engines`` engines from one real sidecar's scrape (fleet_synth.py) and
   backfill ``--hours`` of it at ``--step`` with ``promtool tsdb create-blocks-from
   openmetrics``, one 2-hour file at a time.
2. Serve that TSDB (127.0.0.1, free port) and backfill every recording rule over the last
   ``--rules-hours`` with ``promtool tsdb create-blocks-from rules``, in dependency layers
   (a rule reading another rule's series waits for that layer's blocks).
3. Run every dashboard PromQL target (a range query over the dashboards' default hour at
   60 s steps, or instant where Grafana runs it so; the fleet dashboard on every engine,
   the per-engine ones on one engine and again on one server's All: their server
   variable has no All), every recording rule and every
   alert expression (instant, at the data's end) with ``stats=all``: latency (the
   client's and Prometheus' own evalTotalTime), samples read, series returned.
4. Two more Prometheus servers: one scrapes the same fleet live (with the rule file) and
   remote-writes everything to the other (``--web.enable-remote-write-receiver``); every
   fleet rule and dashboard query is asked of both at the same instant and compared.

Prints one JSON object; a report, never an assertion. A scrape to start from:
``curl -s http://127.0.0.1:9477/metrics`` of a sidecar with an engine in sync.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fleet_live import compare_pair  # noqa: E402
from fleet_synth import Fleet, openmetrics_chunks, read_exposition  # noqa: E402

from kvscope.localvllm.server import free_port  # noqa: E402
from tests.stack.dashquery import interpolate, load, panels, targets  # noqa: E402
from tests.stack.promstack import Proc, binary, load_rules, ready  # noqa: E402

VALUES = {"server": ".*", "engine": ".*", "model": ".*", "client": ".*", "top": "10",
          "__rate_interval": "4m", "__interval": "1m", "__range": "1h"}
"""Every variable on All; Grafana's $__rate_interval for a 60 s scrape (4 x the interval)."""
ONE_ENGINE = {**VALUES, "server": "gpu-0007:8000", "engine": "0"}
"""A per-engine dashboard as it is used: one engine picked."""
ONE_SERVER = {**VALUES, "server": "gpu-0007:8000"}
"""A per-engine dashboard at its widest: one server (it has no All), All of its engines."""


def start_prometheus(work: Path, name: str, tsdb: Path, config: dict[str, Any],
                     *extra: str) -> tuple[Proc, str]:
    cfg = work / f"{name}.yml"
    cfg.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = Proc(name, [binary("prometheus"), f"--config.file={cfg}",
                       f"--storage.tsdb.path={tsdb}", "--storage.tsdb.retention.time=30d",
                       f"--web.listen-address=127.0.0.1:{port}", *extra], work / f"{name}.log")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if ready(base):
                return proc, base
        except httpx.HTTPError:
            pass
        if not proc.alive():
            break
        time.sleep(0.5)
    proc.stop()
    raise RuntimeError(proc.tail())


def backfill(fleet: Fleet, start: float, end: float, step: float, work: Path,
             tsdb: Path) -> dict[str, Any]:
    t0, samples, chunks = time.monotonic(), 0, 0
    for path, n in openmetrics_chunks(fleet, start, end, step, work):
        subprocess.run([binary("promtool"), "tsdb", "create-blocks-from", "openmetrics",
                        "--quiet", str(path), str(tsdb)], check=True, timeout=3600)
        path.unlink()
        samples, chunks = samples + n, chunks + 1
    return {"series": len(fleet.series), "samples": samples, "files": chunks,
            "seconds": round(time.monotonic() - t0, 1)}


def rule_layers(rules: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Recording rules by dependency depth: layer k reads only layers < k."""
    recorded = {r["record"] for r in rules}
    depth: dict[str, int] = {}
    for r in rules:  # the rule file lists a rule after the ones it reads
        uses = [n for n in recorded if re.search(rf"(?<![\w:]){re.escape(n)}(?![\w:])",
                                                  r["expr"]) and n != r["record"]]
        depth[r["record"]] = 1 + max((depth[n] for n in uses), default=-1)
    out: list[list[dict[str, Any]]] = [[] for _ in range(max(depth.values()) + 1)]
    for r in rules:
        out[depth[r["record"]]].append(r)
    return out


def backfill_rules(work: Path, tsdb: Path, start: float, end: float) -> tuple[Proc, str, float]:
    """Serve the TSDB, add each layer's rule blocks, restart; return the serving one."""
    t0 = time.monotonic()
    proc, base = start_prometheus(work, "held", tsdb, {"global": {"scrape_interval": "60s"}})
    records = [r for r in load_rules() if "record" in r]
    for i, layer in enumerate(rule_layers(records)):
        rules = work / f"layer{i}.yml"
        rules.write_text(yaml.safe_dump({"groups": [{"name": f"layer{i}", "rules": layer}]}))
        out = work / f"rules{i}"
        subprocess.run([binary("promtool"), "tsdb", "create-blocks-from", "rules", "--quiet",
                        f"--url={base}", f"--start={int(start)}", f"--end={int(end)}",
                        "--eval-interval=60s", f"--output-dir={out}", str(rules)],
                       check=True, timeout=3600, capture_output=True)
        proc.stop()
        for block in out.iterdir():
            block.rename(tsdb / block.name)
        proc, base = start_prometheus(work, "held", tsdb, {"global": {"scrape_interval": "60s"}})
    return proc, base, time.monotonic() - t0


def timed(base: str, expr: str, at: float, range_s: float = 0) -> dict[str, Any]:
    params: dict[str, Any] = {"query": expr, "stats": "all"}
    path = "query"
    if range_s:
        path, params = "query_range", {**params, "start": at - range_s, "end": at, "step": 60}
    else:
        params["time"] = at
    t0 = time.perf_counter()
    body = httpx.get(f"{base}/api/v1/{path}", params=params, timeout=120).json()
    wall = time.perf_counter() - t0
    if body.get("status") != "success":
        return {"error": body.get("error", body)}
    stats = body["data"].get("stats", {})
    return {"wall_s": round(wall, 4),
            "eval_s": round(stats.get("timings", {}).get("evalTotalTime", 0), 4),
            "samples": stats.get("samples", {}).get("totalQueryableSamples"),
            "peak_samples": stats.get("samples", {}).get("peakSamples"),
            "series": len(body["data"]["result"])}


def instant_targets() -> set[str]:
    """Keys of the dashboard targets Grafana runs as instant queries (the tables)."""
    out = set()
    for uid, d in load().items():
        for p in panels(d):
            for t in p.get("targets", []):
                if t.get("instant") and not t.get("range"):
                    out.add(f"{uid} / {p['title']} / {t['refId']}")
    return out


def queries(per_engine: dict[str, str] = ONE_ENGINE) -> dict[str, tuple[str, float]]:
    """Name -> (expression, range in seconds; 0 for an instant query). The fleet
    dashboard reads every engine; the others ``per_engine``'s variables (one engine)."""
    out = {}
    instant = instant_targets()
    for t in targets(load()):
        if t.kind != "prometheus":
            continue
        values = VALUES if t.uid == "kvscope-fleet" else per_engine
        rng = 0.0 if t.key in instant else 3600.0
        out[f"dashboard {t.key}"] = (interpolate(t.text, values), rng)
    for r in load_rules():
        name = r.get("record") or f"{r['alert']}[{r['labels']['severity']}]"
        out[f"{'rule' if 'record' in r else 'alert'} {name}"] = (r["expr"], 0.0)
    return out


def measure_held(base: str, at: float,
                 per_engine: dict[str, str] = ONE_ENGINE) -> dict[str, Any]:
    results = {name: timed(base, expr, at, rng)
               for name, (expr, rng) in queries(per_engine).items()}
    ok = {k: v for k, v in results.items() if "error" not in v}
    slow = sorted(ok, key=lambda k: -ok[k]["wall_s"])
    return {"queries": len(results), "errors": {k: v for k, v in results.items() if k not in ok},
            "over_1s": [k for k in slow if ok[k]["wall_s"] >= 1.0],
            "slowest": {k: ok[k] for k in slow[:12]},
            "max_eval_s": max(v["eval_s"] for v in ok.values()),
            "max_samples": max((v["samples"] or 0) for v in ok.values()),
            "all": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--exposition", type=Path, required=True)
    ap.add_argument("--engines", type=int, default=1000)
    ap.add_argument("--hours", type=float, default=6.0)
    ap.add_argument("--step", type=float, default=60.0)
    ap.add_argument("--rules-hours", type=float, default=1.5)
    ap.add_argument("--live-s", type=float, default=150.0,
                    help="how long the live pair scrapes before the comparison")
    ap.add_argument("--out", type=Path, help="also write the full JSON here")
    args = ap.parse_args()
    end = float(int(time.time() // 60 * 60))
    start = end - args.hours * 3600
    samples = read_exposition(args.exposition.read_text())
    fleet = Fleet(samples, args.engines, origin=start)
    report: dict[str, Any] = {"engines": args.engines, "hours": args.hours, "step_s": args.step}
    with tempfile.TemporaryDirectory(prefix="kvscope-fleet-") as tmp:
        work = Path(tmp)
        tsdb = work / "tsdb"
        report["backfill"] = backfill(fleet, start, end, args.step, work, tsdb)
        proc, base, rules_s = backfill_rules(work, tsdb, end - args.rules_hours * 3600, end)
        report["rule_backfill_s"] = round(rules_s, 1)
        try:
            report["held"] = measure_held(base, end)
            report["held_one_server"] = measure_held(base, end, ONE_SERVER)
        finally:
            proc.stop()
        report["tsdb_bytes"] = sum(f.stat().st_size for f in tsdb.rglob("*") if f.is_file())
        report["pair"] = compare_pair(fleet, work, queries(), args.live_s, start_prometheus)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    summary = {k: v for k, v in report.items() if not k.startswith(("held", "pair"))}
    for k in ("held", "held_one_server"):
        summary[k] = {k2: v for k2, v in report[k].items() if k2 != "all"}
    summary["pair"] = {k: v for k, v in report["pair"].items() if k != "answers"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
