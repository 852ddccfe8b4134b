"""Probe cost per scheduler step, in the twin (vLLM's real Scheduler, no model).

For each pool size the same seeded workload runs with the probe off (hooks not
installed) and on (hooks installed, a real Sender streaming over ``ipc://`` to a real
``kvscope serve`` subprocess). The probe patches vLLM's classes and cannot be removed, so
each mode runs in its own worker subprocess; workers alternate off, on, off, on, ... and
each runs every pool size. The figures are reported side by side, never asserted.

    python benchmarks/probe_step_cost.py [--quick] [--rounds N] [--out DIR]

Per pool size it reports: ``schedule()`` wall time p50 / p99 off and on and their
difference (the probe's cost per step), the same for the whole engine step
(``schedule()`` + ``update_from_output()``, where the pool hooks fire too), the probe's
self-reported engine-thread time per step (the sidecar's
``kvscope_probe_overhead_seconds_total`` / steps), the cost of ``Recorder.keyframe`` at
the step where the pool was fullest, records dropped, and the sidecar's ledger
mismatches and gaps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Sidecar, machine_noise, median, percentile
from twin_run import POOLS, run_worker

TARGET_P50_US, TARGET_P99_US = 20.0, 100.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one short round, for smoke checks")
    p.add_argument("--rounds", type=int, default=None, help="off/on worker pairs (default 3)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 2400)")
    p.add_argument("--pools", type=int, nargs="+", default=list(POOLS))
    p.add_argument("--out", type=Path, default=None, help="directory for raw results")
    p.add_argument("--worker", choices=("off", "on"), help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--sidecar-url", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.requests = args.requests or (300 if args.quick else 2400)
    return args


def run_round(args: argparse.Namespace, mode: str, rnd: int, endpoint: str,
              sidecar: Sidecar, out: Path) -> dict[str, Any]:
    """One worker subprocess: every pool size in ``mode``; returns its JSON result."""
    result = out / f"{mode}-r{rnd}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", mode,
            "--round", str(rnd), "--requests", str(args.requests),
            "--pools", *map(str, args.pools), "--endpoint", endpoint,
            "--sidecar-url", sidecar.url, "--result", str(result)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    before = machine_noise()
    started = time.monotonic()
    with (out / f"{mode}-r{rnd}.log").open("wb") as log:
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                       env=env, check=True)
    data: dict[str, Any] = json.loads(result.read_text())
    data["wall_s"] = time.monotonic() - started
    data["noise_before"], data["noise_after"] = before, machine_noise()
    print(f"  round {rnd} probe {mode}: {data['wall_s']:.0f} s, "
          f"loadavg {before['loadavg_1m']:.2f}, other vLLM pids {before['vllm_pids']}",
          file=sys.stderr, flush=True)
    return data


def _pct(samples: list[int]) -> tuple[float, float, float]:
    return (percentile(samples, 0.5), percentile(samples, 0.99),
            sum(samples) / len(samples) if samples else 0.0)


def summarise_pool(pool: str, offs: list[dict[str, Any]], ons: list[dict[str, Any]]
                   ) -> dict[str, Any]:
    """Pooled percentiles over all rounds of a mode; cost = on minus off."""
    row: dict[str, Any] = {"pool_blocks": int(pool)}
    for part in ("schedule", "step"):
        key = f"{part}_ns"
        off = [t for r in offs for t in r["pools"][pool][key]]
        on = [t for r in ons for t in r["pools"][pool][key]]
        (o50, o99, omean), (n50, n99, nmean) = _pct(off), _pct(on)
        row[part] = {"off_p50_us": o50 / 1e3, "off_p99_us": o99 / 1e3,
                     "on_p50_us": n50 / 1e3, "on_p99_us": n99 / 1e3,
                     "cost_p50_us": (n50 - o50) / 1e3, "cost_p99_us": (n99 - o99) / 1e3,
                     "cost_mean_us": (nmean - omean) / 1e3,
                     "per_round_cost_p50_us": [
                         (percentile(n["pools"][pool][key], 0.5)
                          - percentile(o["pools"][pool][key], 0.5)) / 1e3
                         for o, n in zip(offs, ons, strict=False)]}
    first = ons[0]["pools"][pool]
    row["workload"] = {k: first[k] for k in ("steps", "preemptions", "finished",
                                             "peak_used_ratio", "pool_reach_ratio",
                                             "blocks_given_per_usable_block")}
    row["same_schedule_off_on"] = all(
        r["pools"][pool]["steps"] == first["steps"]
        and r["pools"][pool]["preemptions"] == first["preemptions"] for r in offs + ons)
    row["add_request_cost_us"] = (
        median([r["pools"][pool]["add_mean_ns"] for r in ons])
        - median([r["pools"][pool]["add_mean_ns"] for r in offs])) / 1e3
    probes = [r["pools"][pool]["probe"] for r in ons]
    row["self_reported_us_per_step"] = median(
        [p["overhead_s"] / p["sidecar"]["steps"] * 1e6 for p in probes if p["sidecar"]["steps"]])
    row["keyframe_p50_us"] = median([p["keyframe"]["p50_ns"] / 1e3 for p in probes])
    row["keyframe_max_us"] = max(p["keyframe"]["max_ns"] / 1e3 for p in probes)
    row["keyframe_at"] = {k: probes[0]["keyframe"][k] for k in ("running", "table_blocks")}
    row["full_scan_ms"] = median([p["keyframe"]["full_scan_ns"] / 1e6 for p in probes])
    row["dropped"] = sum(p["recorder"]["ring_dropped"] + p["recorder"]["send_dropped"]
                         for p in probes)
    row["sidecar_dropped"] = sum(p["sidecar"]["probe_records_dropped"] for p in probes)
    row["ledger_mismatches"] = sum(p["sidecar"]["ledger_mismatches"] for p in probes)
    row["ledger_gaps"] = sum(p["sidecar"]["ledger_gaps"] for p in probes)
    row["probe_faults"] = sum(p["recorder"]["faults"] for p in probes)
    row["sidecar_steps_match"] = all(
        p["sidecar"]["steps"] == r["pools"][pool]["steps"] for p, r in zip(probes, ons))
    row["sidecar_synced"] = all(p["sidecar"]["synced"] for p in probes)
    return row


def print_tables(rows: list[dict[str, Any]], rounds: int) -> None:
    print(f"\nprobe cost per scheduler step, twin, {rounds} off/on round(s) pooled "
          f"(target: cost p50 <= {TARGET_P50_US:g} us, p99 <= {TARGET_P99_US:g} us)")
    head = (f"{'pool':>7} {'what':<9} {'off p50':>8} {'off p99':>8} {'on p50':>8} "
            f"{'on p99':>8} {'cost p50':>9} {'cost p99':>9} {'cost mean':>9}   (us)")
    print(head)
    for r in rows:
        for part, label in (("schedule", "schedule"), ("step", "sch+upd")):
            s = r[part]
            print(f"{r['pool_blocks']:>7} {label:<9} {s['off_p50_us']:>8.1f} "
                  f"{s['off_p99_us']:>8.1f} {s['on_p50_us']:>8.1f} {s['on_p99_us']:>8.1f} "
                  f"{s['cost_p50_us']:>9.1f} {s['cost_p99_us']:>9.1f} {s['cost_mean_us']:>9.1f}")
    print(f"\n{'pool':>7} {'steps':>6} {'preempt':>7} {'peak used':>9} {'reach':>6} "
          f"{'self/step':>9} {'add/req':>8} {'kf p50':>8} {'kf max':>8} {'scan ms':>8} "
          f"{'dropped':>7} {'mismatch':>8} {'gaps':>5} {'same':>5}")
    for r in rows:
        w = r["workload"]
        print(f"{r['pool_blocks']:>7} {w['steps']:>6} {w['preemptions']:>7} "
              f"{w['peak_used_ratio']:>9.0%} {w['pool_reach_ratio']:>6.0%} "
              f"{r['self_reported_us_per_step']:>8.1f}u {r['add_request_cost_us']:>7.1f}u "
              f"{r['keyframe_p50_us']:>7.0f}u {r['keyframe_max_us']:>7.0f}u "
              f"{r['full_scan_ms']:>8.1f} {r['dropped']:>7} {r['ledger_mismatches']:>8} "
              f"{r['ledger_gaps']:>5} {str(r['same_schedule_off_on'] and r['sidecar_steps_match']):>5}")


def orchestrate(args: argparse.Namespace) -> None:
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    # ipc:// paths must fit in sockaddr_un (~107 bytes): keep the socket in a short dir.
    sockdir = Path(tempfile.mkdtemp(prefix="kvb-"))
    endpoint = f"ipc://{sockdir}/probe.sock"
    sidecar = Sidecar(endpoint, out / "sidecar.log")
    sidecar.start()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        for rnd in range(args.rounds):
            for mode in ("off", "on"):
                runs[mode].append(run_round(args, mode, rnd, endpoint, sidecar, out))
    finally:
        sidecar.stop()
    rows = [summarise_pool(str(p), runs["off"], runs["on"]) for p in args.pools]
    print_tables(rows, args.rounds)
    summary = {"benchmark": "probe_step_cost", "rounds": args.rounds,
               "requests": args.requests, "raw_results": str(out), "pools": rows,
               "noise": [r["noise_before"] for r in runs["off"] + runs["on"]]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nraw per-step results: {out}")
    print(json.dumps(summary, separators=(",", ":")))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
    else:
        orchestrate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
