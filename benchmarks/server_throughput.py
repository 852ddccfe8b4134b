"""Real vLLM CPU server throughput with the probe off and on, interleaved A/B runs.

Each run starts a fresh vLLM server on 127.0.0.1 serving the tiny Llama (probe on:
``KVSCOPE_PROBE_ENDPOINT`` points at a ``kvscope serve`` subprocess that lives for the
whole benchmark), sends a short warm-up, then the measured load, and stops the server.
Runs go off, on, off, on, ... and only one server runs at a time, under an exclusive
``flock`` on /tmp/kvscope-vllm.lock. Figures and ratios are reported, never asserted.

    python benchmarks/server_throughput.py [--quick] [--rounds N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    Sidecar,
    git_state,
    machine_noise,
    median,
    noise_line,
    process_cpu_s,
    scrape,
    vllm_lock,
    wait_engine_steps,
)

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.localvllm.server import ServerSpec, VllmServer, free_port, live_group_pids
from kvscope.models.config import default_cache_dir
from kvscope.models.tiny import make_tiny_model

TARGET_RATIO = 0.99
WARMUP = LoadSpec(n_requests=8, concurrency=8, seed=1000)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one short off/on pair, smoke check")
    p.add_argument("--rounds", type=int, default=None, help="off/on pairs (default 3)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 120)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="directory for logs and results")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.requests = args.requests or (24 if args.quick else 120)
    return args


def vllm_totals(url: str) -> dict[str, float]:
    """vLLM's own preemption and generated-token counters (summed over label sets)."""
    totals = {"preemptions": 0.0, "generation_tokens": 0.0}
    for (name, _engine), value in scrape(url).items():
        if name == "vllm:num_preemptions_total":
            totals["preemptions"] += value
        elif name == "vllm:generation_tokens_total":
            totals["generation_tokens"] += value
    return totals


def group_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds used so far by the server's processes, by role. The probe records in
    EngineCore (hooks on its engine thread, plus its sender thread)."""
    roles = {"api": 0.0, "engine_core": 0.0, "worker": 0.0}
    for pid in live_group_pids(pgid):
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
            cpu = process_cpu_s(pid)
        except (OSError, ValueError):
            continue
        role = ("engine_core" if "EngineCore" in name else "worker" if "Worker" in name
                else "api")
        roles[role] += cpu
    return roles


def probe_view(sidecar: Sidecar, engine: str) -> dict[str, Any]:
    """What the sidecar heard from this run's probe (warm-up included)."""
    seen = wait_engine_steps(sidecar.url, engine, None, timeout_s=30.0) or {}
    metrics = scrape(sidecar.url)
    steps = seen.get("steps", 0)
    per_step = 1e6 / steps if steps else 0.0
    return {
        "steps": steps,
        "preemptions": sum(seen.get("preemptions", {}).values()),
        "dropped": seen.get("probe_records_dropped"),
        "faults": seen.get("probe_faults"),
        "ledger_mismatches": seen.get("ledger_mismatches"),
        "ledger_gaps": seen.get("ledger_gaps"),
        "synced": seen.get("synced"),
        "self_reported_us_per_step":
            metrics.get(("kvscope_probe_overhead_seconds_total", engine), 0.0) * per_step,
        "schedule_us_per_step":
            metrics.get(("kvscope_engine_schedule_seconds_total", engine), 0.0) * per_step,
    }


def one_run(args: argparse.Namespace, mode: str, rnd: int, model_dir: Path,
            sidecar: Sidecar, out: Path) -> dict[str, Any]:
    engine = f"on-r{rnd}"
    env = ({"KVSCOPE_PROBE_ENDPOINT": sidecar.endpoint, "KVSCOPE_ENGINE": engine}
           if mode == "on" else {})
    load = LoadSpec(n_requests=args.requests, concurrency=args.concurrency)
    with vllm_lock() as waited:
        noise = machine_noise()
        spec = ServerSpec(model_dir, free_port(), extra_env=env)
        with VllmServer(spec, log_path=out / f"vllm-{mode}-r{rnd}.log") as server:
            run_load_sync(server.url, WARMUP)
            cpu0, group0 = sidecar.cpu_seconds(), group_cpu(server.pid)
            result = run_load_sync(server.url, load)
            sidecar_cpu = sidecar.cpu_seconds() - cpu0
            group1 = group_cpu(server.pid)
            cpu = {k: group1[k] - group0[k] for k in group0}
            totals = vllm_totals(server.url)
            probe = probe_view(sidecar, engine) if mode == "on" else None
    row = {"mode": mode, "round": rnd, "lock_wait_s": waited, "startup_s": server.startup_s,
           "noise_before": noise, "sidecar_cpu_s": sidecar_cpu, "server_cpu_s": cpu,
           "engine_core_cpu_ms_per_1k_tokens":
               cpu["engine_core"] * 1e6 / max(1, result.completion_tokens),
           "vllm": totals,
           "probe": probe, **result.summary()}
    print(f"  round {rnd} probe {mode}: {row['completion_tokens_per_s']:.1f} tok/s, "
          f"{row['ok']}/{row['requests']} ok, {row['elapsed_s']:.1f} s, "
          f"vLLM preemptions {totals['preemptions']:.0f}, loadavg {noise['loadavg_1m']:.2f}",
          file=sys.stderr, flush=True)
    return row


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    off = [r for r in runs if r["mode"] == "off"]
    on = [r for r in runs if r["mode"] == "on"]
    tps_off = [r["completion_tokens_per_s"] for r in off]
    tps_on = [r["completion_tokens_per_s"] for r in on]
    pairs = [n["completion_tokens_per_s"] / o["completion_tokens_per_s"]
             for o, n in zip(off, on, strict=False) if o["completion_tokens_per_s"]]
    return {
        "median_tokens_per_s_off": median(tps_off),
        "median_tokens_per_s_on": median(tps_on),
        "ratio_of_medians": median(tps_on) / median(tps_off) if median(tps_off) else None,
        "median_paired_ratio": median(pairs),
        "paired_ratios": pairs,
        "median_latency_p50_s_off": median([r["latency_p50_s"] for r in off]),
        "median_latency_p50_s_on": median([r["latency_p50_s"] for r in on]),
        "median_latency_p99_s_off": median([r["latency_p99_s"] for r in off]),
        "median_latency_p99_s_on": median([r["latency_p99_s"] for r in on]),
        "median_engine_core_cpu_ms_per_1k_tokens_off":
            median([r["engine_core_cpu_ms_per_1k_tokens"] for r in off]),
        "median_engine_core_cpu_ms_per_1k_tokens_on":
            median([r["engine_core_cpu_ms_per_1k_tokens"] for r in on]),
        "errors": sum(r["error_count"] for r in runs),
    }


def _probe_cols(p: dict[str, Any] | None) -> str:
    if not p:
        return f"{'-':>11} {'-':>11} {'-':>8} {'-':>8} {'-':>5} {'-':>5}"
    return (f"{p['steps']:>11} {p['preemptions']:>11} {p['self_reported_us_per_step']:>6.1f}us "
            f"{p['schedule_us_per_step']:>6.0f}us {p['dropped']:>5} {p['ledger_mismatches']:>5}")


def print_table(runs: list[dict[str, Any]], s: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nvLLM CPU server, tiny Llama, {args.requests} requests x {args.concurrency} "
          f"concurrent per run, one server at a time, off/on interleaved (target on/off >= "
          f"{TARGET_RATIO})")
    print(f"{'run':<7} {'tok/s':>7} {'elapsed':>8} {'lat p50':>8} {'lat p99':>8} "
          f"{'ok':>5} {'vLLM pre':>8} {'probe steps':>11} {'kvscope pre':>11} "
          f"{'self/st':>8} {'sched/st':>8} {'drop':>5} {'mism':>5} {'core ms/1k':>10} "
          f"{'sidecar cpu':>11}")
    for r in runs:
        print(f"{r['mode'] + '-r' + str(r['round']):<7} {r['completion_tokens_per_s']:>7.1f} "
              f"{r['elapsed_s']:>7.1f}s {r['latency_p50_s']:>7.2f}s {r['latency_p99_s']:>7.2f}s "
              f"{r['ok']:>5} {r['vllm']['preemptions']:>8.0f} {_probe_cols(r['probe'])} "
              f"{r['engine_core_cpu_ms_per_1k_tokens']:>10.0f} {r['sidecar_cpu_s']:>10.2f}s")
    cpu_off = s["median_engine_core_cpu_ms_per_1k_tokens_off"]
    cpu_on = s["median_engine_core_cpu_ms_per_1k_tokens_on"]
    print(f"median EngineCore CPU per 1k completion tokens: off {cpu_off:.0f} ms, on "
          f"{cpu_on:.0f} ms (on/off {cpu_on / cpu_off if cpu_off else float('nan'):.3f})")
    print(f"median tok/s off {s['median_tokens_per_s_off']:.1f}, on "
          f"{s['median_tokens_per_s_on']:.1f}; on/off ratio of medians "
          f"{s['ratio_of_medians']:.3f}; paired ratios "
          f"{', '.join(f'{x:.3f}' for x in s['paired_ratios'])} (median "
          f"{s['median_paired_ratio']:.3f})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds through the finally blocks, so servers and the sidecar stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for name in [k for k in os.environ if k.startswith("KVSCOPE_")]:
        del os.environ[name]  # the off server must not inherit a probe endpoint
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(default_cache_dir() / "tiny-llama")
    sockdir = Path(tempfile.mkdtemp(prefix="kvb-"))  # short: ipc paths fit sockaddr_un
    sidecar = Sidecar(f"ipc://{sockdir}/probe.sock", out / "sidecar.log")
    sidecar.start()
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for rnd in range(args.rounds):
            for mode in ("off", "on"):
                runs.append(one_run(args, mode, rnd, model_dir, sidecar, out))
    finally:
        sidecar.stop()
    summary = summarise(runs)
    print_table(runs, summary, args)
    print(noise_line([r["noise_before"] for r in runs]))
    report = {"benchmark": "server_throughput", "rounds": args.rounds,
              "requests": args.requests, "concurrency": args.concurrency,
              "wall_s": time.monotonic() - started, "git": git_state(), "logs": str(out),
              "summary": summary, "runs": runs}
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    print(f"logs and results: {out}")
    print(json.dumps(report, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
