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
``kvscope_probe_overhead_seconds_total{thread="engine"}`` / steps; its sender and zmq_io
threads apart, in the breakdown), the cost of ``Recorder.keyframe`` at
the step where the pool was fullest, records dropped, and the sidecar's ledger
mismatches and gaps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    VLLM_LOCK_PATH,
    Sidecar,
    Sink,
    git_state,
    machine_noise,
    median,
    noise_line,
    percentile,
    vllm_lock,
)
from twin_run import POOLS, run_worker

TARGET_P50_US, TARGET_P99_US = 20.0, 100.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one short round, for smoke checks")
    p.add_argument("--rounds", type=int, default=None, help="off/on worker pairs (default 3)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default 2400)")
    p.add_argument("--pools", type=int, nargs="+", default=list(POOLS))
    p.add_argument("--out", type=Path, default=None, help="directory for raw results")
    p.add_argument("--exclusive", action="store_true",
                   help=f"hold {VLLM_LOCK_PATH} during each worker, so no vLLM server "
                        "(of the engine tests, say) shares the cores with a measurement")
    p.add_argument("--worker", choices=("off", "on"), help=argparse.SUPPRESS)
    p.add_argument("--against", type=Path, default=None, metavar="CHECKOUT",
                   help="also run the probe of another checkout (its exporter/) as a third "
                        "mode, in the same rounds: the two probes side by side in one run")
    p.add_argument("--sink", action="store_true",
                   help="also run the probe sending to a process that discards its frames "
                        "(no sidecar working on the other core), in the same rounds")
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tag", default="", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--sidecar-url", help=argparse.SUPPRESS)
    p.add_argument("--sidecar-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.requests = args.requests or (300 if args.quick else 2400)
    return args


def run_round(args: argparse.Namespace, mode: str, rnd: int, receiver: Sidecar | Sink,
              out: Path) -> dict[str, Any]:
    """One worker subprocess: every pool size in ``mode``; returns its JSON result.
    ``against``: the probe of ``--against``, the worker's ``kvscope`` packages taken
    from that checkout (the sidecar and this harness stay this checkout's); ``sink``:
    the probe on, sending to ``receiver``, a Sink."""
    result = out / f"{mode}-r{rnd}.json"
    argv = [sys.executable, str(Path(__file__).resolve()),
            "--worker", "off" if mode == "off" else "on", "--tag", mode[0],
            "--round", str(rnd), "--requests", str(args.requests),
            "--pools", *map(str, args.pools), "--endpoint", receiver.endpoint,
            "--sidecar-url", receiver.url, "--sidecar-pid", str(receiver.pid),
            "--result", str(result)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    if mode == "against":
        env["PYTHONPATH"] = os.pathsep.join(
            [str(args.against.resolve() / "exporter"), *filter(None, [env.get("PYTHONPATH")])])
    lock = vllm_lock() if args.exclusive else contextlib.nullcontext(0.0)
    with lock, (out / f"{mode}-r{rnd}.log").open("wb") as log:
        before = machine_noise()
        started = time.monotonic()
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                       env=env, check=True)
    data: dict[str, Any] = json.loads(result.read_text())
    data["wall_s"] = time.monotonic() - started
    data["noise_before"], data["noise_after"] = before, machine_noise()
    print(f"  round {rnd} probe {mode}: {data['wall_s']:.0f} s, "
          f"loadavg {before['loadavg_1m']:.2f}, other vLLM pids {before['vllm_pids']}",
          file=sys.stderr, flush=True)
    return data


def _timing(pool: str, key: str, offs: list[dict[str, Any]], ons: list[dict[str, Any]]
            ) -> dict[str, Any]:
    """Percentiles of one per-step series pooled over rounds; cost = on minus off."""
    off = [t for r in offs for t in r["pools"][pool][key]]
    on = [t for r in ons for t in r["pools"][pool][key]]
    o50, o99, n50, n99 = (percentile(off, 0.5), percentile(off, 0.99),
                          percentile(on, 0.5), percentile(on, 0.99))
    mean_cost = sum(on) / max(1, len(on)) - sum(off) / max(1, len(off))
    return {"off_p50_us": o50 / 1e3, "off_p99_us": o99 / 1e3,
            "on_p50_us": n50 / 1e3, "on_p99_us": n99 / 1e3,
            "cost_p50_us": (n50 - o50) / 1e3, "cost_p99_us": (n99 - o99) / 1e3,
            "cost_mean_us": mean_cost / 1e3,
            "per_round_cost_p50_us": [
                (percentile(n["pools"][pool][key], 0.5)
                 - percentile(o["pools"][pool][key], 0.5)) / 1e3
                for o, n in zip(offs, ons, strict=False)]}


def _min_of_rounds(pool: str, key: str, offs: list[dict[str, Any]],
                   ons: list[dict[str, Any]]) -> dict[str, Any]:
    """Each step's fastest time over the rounds of a mode, then percentiles over steps.

    The schedule is the same in every round, so step i does the same work each time:
    taking its minimum drops time lost to other processes (noise only ever adds). It drops
    the probe's own intermittent costs too (sender bursts under the GIL, keyframes), so it
    reads as the probe's steady engine-thread cost, a lower bound of its total cost."""
    def mins(runs: list[dict[str, Any]]) -> list[int]:
        return [min(ts) for ts in zip(*(r["pools"][pool][key] for r in runs), strict=True)]

    fake_off = [{"pools": {pool: {key: mins(offs)}}}]
    fake_on = [{"pools": {pool: {key: mins(ons)}}}]
    row = _timing(pool, key, fake_off, fake_on)
    del row["per_round_cost_p50_us"]
    return row


def _per_step(probes: list[dict[str, Any]], steps: int, value: Any) -> float:
    """Median over rounds of one probe figure divided by the run's steps."""
    return median([value(p) / max(1, steps) for p in probes])


def summarise_pool(pool: str, offs: list[dict[str, Any]], ons: list[dict[str, Any]]
                   ) -> dict[str, Any]:
    first = ons[0]["pools"][pool]
    steps = first["steps"]
    probes = [r["pools"][pool]["probe"] for r in ons]
    return {
        "pool_blocks": int(pool),
        "schedule": _timing(pool, "schedule_ns", offs, ons),
        "step": _timing(pool, "step_ns", offs, ons),
        "schedule_min": _min_of_rounds(pool, "schedule_ns", offs, ons),
        "schedule_cpu": _timing(pool, "schedule_cpu_ns", offs, ons),
        "workload": {k: first[k] for k in (
            "steps", "preemptions", "finished", "scheduled_reqs_per_step", "peak_used_ratio",
            "pool_reach_ratio", "blocks_given_per_usable_block")},
        "same_schedule_off_on": all(
            r["pools"][pool]["steps"] == steps
            and r["pools"][pool]["preemptions"] == first["preemptions"] for r in offs + ons),
        "add_request_cost_us": (median([r["pools"][pool]["add_mean_ns"] for r in ons])
                                - median([r["pools"][pool]["add_mean_ns"] for r in offs])) / 1e3,
        "self_reported_us_per_step": _per_step(probes, steps, lambda p: p["overhead_s"] * 1e6),
        "self_reported_by_thread_us_per_step": {
            t: _per_step(probes, steps, lambda p, t=t: p.get("overhead_by_thread_s", {})
                         .get(t, 0.0) * 1e6) for t in ("engine", "sender", "zmq_io")},
        # whole engine process (engine thread + sender), best of rounds per mode
        "proc_cpu_us_per_step_off": min(r["pools"][pool]["proc_cpu_ns"] for r in offs) / 1e3
        / max(1, steps),
        "proc_cpu_us_per_step_on": min(r["pools"][pool]["proc_cpu_ns"] for r in ons) / 1e3
        / max(1, steps),
        "sender_cpu_us_per_step": _per_step(probes, steps, lambda p: p["sender_cpu_ns"] / 1e3),
        # where the process's CPU went, best of rounds per mode: the engine (main) thread,
        # every other thread (the sender, libzmq's I/O thread), the collector's time
        "main_cpu_us_per_step": {m: min(r["pools"][pool]["main_cpu_ns"] for r in rs) / 1e3
                                 / max(1, steps) for m, rs in (("off", offs), ("on", ons))},
        "other_threads_cpu_us_per_step": {
            m: min(r["pools"][pool]["proc_cpu_ns"] - r["pools"][pool]["main_cpu_ns"]
                   for r in rs) / 1e3 / max(1, steps) for m, rs in (("off", offs), ("on", ons))},
        "gc_us_per_step": {m: median([r["pools"][pool]["gc_ns"] for r in rs]) / 1e3
                           / max(1, steps) for m, rs in (("off", offs), ("on", ons))},
        "gc_runs": {m: median([r["pools"][pool]["gc_runs"] for r in rs])
                    for m, rs in (("off", offs), ("on", ons))},
        "sidecar_cpu_us_per_step": _per_step(probes, steps, lambda p: p["sidecar_cpu_s"] * 1e6),
        "attach_ms": median([p["attach_ns"] / 1e6 for p in probes]),
        "keyframe_p50_us": median([p["keyframe"]["p50_ns"] / 1e3 for p in probes]),
        "keyframe_max_us": max(p["keyframe"]["max_ns"] / 1e3 for p in probes),
        "keyframe_at": {k: probes[0]["keyframe"][k] for k in ("running", "table_blocks")},
        "full_scan_ms": median([p["keyframe"]["full_scan_ns"] / 1e6 for p in probes]),
        "dropped": sum(p["recorder"]["ring_dropped"] + p["recorder"]["send_dropped"]
                       for p in probes),
        "sidecar_reported_dropped": sum(p["sidecar"]["probe_records_dropped"] for p in probes),
        "ledger_mismatches": sum(p["sidecar"]["ledger_mismatches"] for p in probes),
        "ledger_gaps": sum(p["sidecar"]["ledger_gaps"] for p in probes),
        "probe_faults": sum(p["recorder"]["faults"] for p in probes),
        "sidecar_saw_every_step": all(p["sidecar"]["steps"] == steps for p in probes),
        "sidecar_synced": all(p["sidecar"]["synced"] for p in probes),
    }


def print_tables(rows: list[dict[str, Any]], rounds: int) -> None:
    print(f"\nprobe cost per scheduler step in the twin, {rounds} off/on round(s) pooled; "
          f"target cost p50 <= {TARGET_P50_US:g} us, p99 <= {TARGET_P99_US:g} us")
    print(f"{'pool':>7} {'measured':<13} {'off p50':>8} {'off p99':>8} {'on p50':>8} "
          f"{'on p99':>8} {'cost p50':>9} {'cost p99':>9} {'cost mean':>9}  (us)")
    parts = (("schedule", "schedule()"), ("step", "sched+update"),
             ("schedule_min", "sched min-rnd"), ("schedule_cpu", "sched thr-cpu"))
    for r in rows:
        for part, label in parts:
            t = r[part]
            print(f"{r['pool_blocks']:>7} {label:<13} {t['off_p50_us']:>8.1f} "
                  f"{t['off_p99_us']:>8.1f} {t['on_p50_us']:>8.1f} {t['on_p99_us']:>8.1f} "
                  f"{t['cost_p50_us']:>9.1f} {t['cost_p99_us']:>9.1f} {t['cost_mean_us']:>9.1f}")
    print(f"\n{'pool':>7} {'steps':>6} {'reqs/st':>7} {'preempt':>7} {'peak':>5} {'reach':>5} "
          f"{'self/st':>8} {'sender/st':>9} {'sidecar/st':>10} {'add/req':>8} "
          f"{'kf p50':>8} {'kf max':>8} {'scan':>7} {'drop':>5} {'mism':>5} {'gaps':>5} "
          f"{'all seen':>8} {'proc cpu/st off->on':>20}")
    for r in rows:
        w = r["workload"]
        seen = r["same_schedule_off_on"] and r["sidecar_saw_every_step"] and r["sidecar_synced"]
        print(f"{r['pool_blocks']:>7} {w['steps']:>6} {w['scheduled_reqs_per_step']:>7.0f} "
              f"{w['preemptions']:>7} "
              f"{w['peak_used_ratio']:>5.0%} {w['pool_reach_ratio']:>5.0%} "
              f"{r['self_reported_us_per_step']:>6.1f}us {r['sender_cpu_us_per_step']:>7.1f}us "
              f"{r['sidecar_cpu_us_per_step']:>8.1f}us {r['add_request_cost_us']:>6.1f}us "
              f"{r['keyframe_p50_us']:>6.0f}us {r['keyframe_max_us']:>6.0f}us "
              f"{r['full_scan_ms']:>5.1f}ms {r['dropped']:>5} {r['ledger_mismatches']:>5} "
              f"{r['ledger_gaps']:>5} {str(seen):>8} "
              f"{r['proc_cpu_us_per_step_off']:>7.0f}->{r['proc_cpu_us_per_step_on']:.0f}us "
              f"x{r['proc_cpu_us_per_step_on'] / max(1e-9, r['proc_cpu_us_per_step_off']):.3f}")


def print_breakdown(rows: list[dict[str, Any]]) -> None:
    """Where the engine process's CPU went, off -> on (us per step, best of rounds)."""
    print(f"\n{'pool':>7} {'main thread':>16} {'other threads':>15} {'gc time':>14} "
          f"{'gc runs':>14} {'self-report eng/snd/zmq':>24}  (us per step; off -> on)")
    for r in rows:
        m, o, g, n = (r["main_cpu_us_per_step"], r["other_threads_cpu_us_per_step"],
                      r["gc_us_per_step"], r["gc_runs"])
        t = r["self_reported_by_thread_us_per_step"]
        print(f"{r['pool_blocks']:>7} {m['off']:>7.0f}->{m['on']:<7.0f} "
              f"{o['off']:>6.1f}->{o['on']:<7.1f} {g['off']:>5.1f}->{g['on']:<7.1f} "
              f"{n['off']:>6.0f}->{n['on']:<6.0f} "
              f"{t['engine']:>10.1f} / {t['sender']:.1f} / {t['zmq_io']:.1f}")


def orchestrate(args: argparse.Namespace) -> None:
    # A SIGTERM unwinds through the finally blocks, so the sidecar and workers stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    # ipc:// paths must fit in sockaddr_un (~107 bytes): keep the socket in a short dir.
    sockdir = Path(tempfile.mkdtemp(prefix="kvb-"))
    endpoint = f"ipc://{sockdir}/probe.sock"
    sidecar = Sidecar(endpoint, out / "sidecar.log")
    sink = Sink(f"ipc://{sockdir}/sink.sock")
    modes = ["off", "on"] + ["against"] * bool(args.against) + ["sink"] * args.sink
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        sidecar.start()
        if args.sink:
            sink.start()
        for rnd in range(args.rounds):
            for mode in modes:
                runs[mode].append(run_round(args, mode, rnd, sink if mode == "sink"
                                            else sidecar, out))
    finally:
        sidecar.stop()
        sink.stop()
    def report(mode: str, heading: str = "") -> list[dict[str, Any]]:
        """The pools' rows of ``mode`` against the off rounds, printed."""
        rows = [summarise_pool(str(p), runs["off"], runs[mode]) for p in args.pools]
        if heading:
            print(f"\n{heading}")
        print_tables(rows, args.rounds)
        print_breakdown(rows)
        return rows

    rows = report("on")
    extra: dict[str, Any] = {}
    if args.against:
        extra["against"] = {
            "checkout": str(args.against), "git": git_state(args.against),
            "pools": report("against", f"--against {args.against}: the same off rounds, "
                                       "its probe on")}
    if args.sink:
        extra["sink"] = {"pools": report(
            "sink", "--sink: the same off rounds, the probe on, its frames discarded by a "
                    "process that does nothing else (self/st, sidecar/st and all seen do "
                    "not apply)")}
    print(noise_line([r["noise_before"] for m in modes for r in runs[m]]))
    summary = {"benchmark": "probe_step_cost", "rounds": args.rounds,
               "requests": args.requests, "exclusive": args.exclusive, "git": git_state(),
               "raw_results": str(out), "pools": rows, **extra,
               "noise": {f"{m}-r{i}": r["noise_before"]
                         for m in modes for i, r in enumerate(runs[m])}}
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
