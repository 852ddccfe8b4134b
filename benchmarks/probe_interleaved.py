"""The probe's engine-thread cost in place, on and off steps interleaved in one process.

probe_step_cost.py compares whole processes, probe off against probe on: their figures
move by 5-9% from run to run here (the machine, not the probe), more than the probe
costs. This benchmark cancels that drift: every worker runs the same seeded workload on
vLLM's real scheduler with the probe installed, and before each step a seeded coin says
whether the probe records it (``Recorder.enabled``; the blocks-needed hook is armed only
on recorded steps, as the probe would arm it). A second worker runs the complementary
coins, so every step is measured once on and once off, each within a process whose slow
drift falls on its on and off steps alike. Per step: ``schedule()`` wall time, and the
engine thread's CPU over ``schedule()`` + ``update_from_output()`` + the arrivals that
follow (where the probe's free and arrival hooks fire).

Reported per pool, never asserted:
- ``sched cost``: per step, the fastest ``schedule()`` over the workers that recorded it
  minus the fastest over those that did not; p50 / p99 / mean over steps;
- the same cost for the steps that scheduled 16-48, 96-160 and 224-256 requests (the
  issue's batches of 32, 128 and 256);
- ``paired``: engine-thread CPU, per step the least over the workers that recorded it
  and the least over those that did not, summed over steps, on / off (and the difference
  per step in microseconds);
- ``cpu on/off``: engine-thread CPU per step, the mean over recorded steps over the mean
  over unrecorded ones, within each worker, then the median over workers (unpaired: the
  steps differ; the per-worker figures show that spread); and the same as microseconds a
  step.

The steps the probe does not record still pay its wrappers' "not recording" check, and
the ring is emptied every 54 steps (the sender's 0.1 s at ~540 steps a second) outside
the timed calls: the sender thread's own cost is probe_step_cost.py's ``sender/st``.

``--against CHECKOUT`` measures another checkout's probe and ``--floor`` the floor
(``micro_floor.install_floor``: the least exact ledger, its record encoded as the probe
encodes) in the same pairs, their workers interleaved with this checkout's: compare probes
this way, not across runs.

    python benchmarks/probe_interleaved.py [--pairs N] [--requests N] [--pools ...]
        [--against CHECKOUT ...] [--floor]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

from _common import git_state, machine_noise, median, noise_line, percentile
from micro_floor import FloorRecorder, install_floor
from twin_run import twin_config, workload

_now = time.perf_counter_ns
_cpu = time.thread_time_ns
DRAIN_EVERY = 54
BINS = (("16-48", 16, 48), ("96-160", 96, 160), ("224-256", 224, 256))
"""Requests scheduled in a step: the costs of steps near 32, 128 and 256 apart."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="pairs of complementary workers")
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--pools", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--against", type=Path, action="append", default=[], metavar="CHECKOUT",
                   help="also measure another checkout's probe (its exporter/), its workers "
                        "interleaved with this one's in the same pairs")
    p.add_argument("--floor", action="store_true",
                   help="also measure the floor (micro_floor.install_floor) the same way")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--as-floor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--flip", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def coins(seed: int, n: int, flip: bool) -> list[bool]:
    rng = random.Random(seed)
    return [(rng.random() < 0.5) != flip for _ in range(n)]


def run_pool(pool: int, requests: list[Any], on: list[bool], floor: bool) -> dict[str, Any]:
    from kvscope.twin.engine import Twin
    from kvscope_probe import plugin
    from kvscope_probe.recorder import Recorder

    twin = Twin(twin_config(pool), seed=0)
    sched = twin.scheduler
    if floor:
        rec: Any = FloorRecorder(sched)
    else:
        rec = Recorder(sched, ring_size=1 << 20, keyframe_interval_s=5.0)
        rec.push(rec.hello)
    plugin.bind(sched, rec)
    cls = type(sched)
    o_schedule, o_update = cls.schedule, cls.update_from_output
    sched_ns, cpu_ns, reqs = array("q"), array("q"), array("q")
    state = {"i": 0, "cpu0": 0}

    def schedule() -> Any:
        i = state["i"]
        if i:  # the step before ends here: its update and the arrivals after it
            cpu_ns.append(_cpu() - state["cpu0"])
        rec.enabled = recording = i < len(on) and on[i]
        # the hook is armed only while the probe records, as its step record would arm it
        rec.watch_need(rec.pool.get_num_free_blocks() if recording else 1 << 62)
        if i % DRAIN_EVERY == 0:
            rec.ring.clear()
            rec.popped_bytes = rec.pushed_bytes
        state["i"] = i + 1
        c0 = _cpu()
        t0 = _now()
        out = o_schedule(sched)
        sched_ns.append(_now() - t0)
        state["cpu0"] = c0
        reqs.append(len(out.num_scheduled_tokens))
        return out

    sched.schedule = schedule
    sched.update_from_output = lambda out, mo: o_update(sched, out, mo)
    res = twin.run(requests)
    cpu_ns.append(_cpu() - state["cpu0"])
    return {"steps": res.steps, "schedule_ns": list(sched_ns), "cpu_ns": list(cpu_ns),
            "reqs": list(reqs), "faults": rec.faults, "records": rec.seq}


def run_worker(args: argparse.Namespace) -> None:
    import kvscope.twin.engine  # noqa: F401 - imports vLLM before the timed part
    from kvscope_probe import plugin

    if args.as_floor:
        install_floor()
    elif not plugin.enable(None):
        raise SystemExit("the probe's hooks could not be installed")
    requests = workload(args.requests)
    pools = {}
    for pool in args.pools:
        on = coins(1000 * args.worker + pool, 1 << 16, args.flip)
        run_pool(pool, requests[: len(requests) // 8], on, args.as_floor)  # warm-up
        pools[str(pool)] = {**run_pool(pool, requests, on, args.as_floor), "on": on}
    args.result.write_text(json.dumps({"pools": pools}))


def summarise(pool: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    data = [r["pools"][pool] for r in runs]
    steps = min(d["steps"] for d in data)
    cost = []
    cpu_on = cpu_off = 0
    binned: dict[str, list[float]] = {b: [] for b, _, _ in BINS}
    for i in range(steps):
        on = [d["schedule_ns"][i] for d in data if d["on"][i]]
        off = [d["schedule_ns"][i] for d in data if not d["on"][i]]
        if on and off:
            cost.append((min(on) - min(off)) / 1e3)
            cpu_on += min(d["cpu_ns"][i] for d in data if d["on"][i])
            cpu_off += min(d["cpu_ns"][i] for d in data if not d["on"][i])
            n = data[0]["reqs"][i]
            for b, low, high in BINS:
                if low <= n <= high:
                    binned[b].append(cost[-1])
    ratios, deltas, offs = [], [], []
    for d in data:
        cpu = d["cpu_ns"][:steps]
        on = [c for c, o in zip(cpu, d["on"], strict=False) if o]
        off = [c for c, o in zip(cpu, d["on"], strict=False) if not o]
        m_on, m_off = sum(on) / len(on), sum(off) / len(off)
        ratios.append(m_on / m_off)
        deltas.append((m_on - m_off) / 1e3)
        offs.append(m_off / 1e3)
    return {
        "pool": int(pool), "steps": steps, "paired_steps": len(cost),
        "same_schedule": len({d["steps"] for d in data}) == 1,
        "faults": sum(d["faults"] for d in data),
        "sched_cost_p50_us": percentile(cost, 0.5), "sched_cost_p99_us": percentile(cost, 0.99),
        "sched_cost_mean_us": sum(cost) / len(cost),
        "sched_cost_by_reqs": {b: {"steps": len(v), "p50_us": percentile(v, 0.5),
                                   "p99_us": percentile(v, 0.99)} for b, v in binned.items()
                               if v},
        "cpu_paired_ratio": cpu_on / cpu_off,
        "cpu_paired_delta_us": (cpu_on - cpu_off) / 1e3 / len(cost),
        "cpu_ratio": median(ratios), "cpu_ratios": ratios,
        "cpu_delta_us": median(deltas), "cpu_off_us": median(offs),
    }


def probes(args: argparse.Namespace) -> list[tuple[str, dict[str, str], list[str]]]:
    """(name, environment, extra worker arguments) of every probe measured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    out = [("this checkout", env, [])]
    for checkout in args.against:
        path = os.pathsep.join([str(checkout.resolve() / "exporter"),
                                *filter(None, [env.get("PYTHONPATH")])])
        out.append((str(checkout), {**env, "PYTHONPATH": path}, []))
    if args.floor:
        out.append(("floor", env, ["--as-floor"]))
    return out


def orchestrate(args: argparse.Namespace) -> None:
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-interleaved-"))
    out.mkdir(parents=True, exist_ok=True)
    kinds = probes(args)
    runs: dict[str, list[Any]] = {name: [] for name, _, _ in kinds}
    noise = []
    for pair in range(args.pairs):
        for flip in (False, True) if pair % 2 == 0 else (True, False):
            for k, (name, env, extra) in enumerate(kinds):
                result = out / f"p{k}-w{pair}-{int(flip)}.json"
                noise.append(machine_noise())
                argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(pair),
                        "--requests", str(args.requests), "--pools", *map(str, args.pools),
                        "--result", str(result), *extra] + ["--flip"] * flip
                started = time.monotonic()
                with result.with_suffix(".log").open("wb") as log:
                    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env=env, check=True)
                print(f"  pair {pair} flip {flip} {name}: {time.monotonic() - started:.0f} s,"
                      f" loadavg {noise[-1]['loadavg_1m']:.2f}", file=sys.stderr, flush=True)
                runs[name].append(json.loads(result.read_text()))
    summary: dict[str, Any] = {"benchmark": "probe_interleaved", "pairs": args.pairs,
                               "requests": args.requests, "git": git_state(), "raw": str(out),
                               "probes": {}}
    for name, _, _ in kinds:
        # each pair's two workers hold every step once on and once off
        rows = [summarise(pool, runs[name]) for pool in map(str, args.pools)]
        summary["probes"][name] = rows
        print(f"\n{name}:")
        print_rows(rows)
    print(noise_line(noise))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, separators=(",", ":")))


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'pool':>7} {'steps':>6} {'sched cost p50/p99/mean us':>28} "
          f"{'cpu/step off us':>16} {'paired +us':>11} {'paired':>8} {'cpu +us':>8} "
          f"{'cpu on/off':>11} {'faults':>7}")
    for r in rows:
        print(f"{r['pool']:>7} {r['steps']:>6} {r['sched_cost_p50_us']:>9.1f} / "
              f"{r['sched_cost_p99_us']:.1f} / {r['sched_cost_mean_us']:.1f} "
              f"{r['cpu_off_us']:>16.0f} {r['cpu_paired_delta_us']:>11.1f} "
              f"x{r['cpu_paired_ratio']:.4f} {r['cpu_delta_us']:>8.1f} x{r['cpu_ratio']:.4f} "
              f"{r['faults']:>7}   (per worker: "
              + ", ".join(f"x{x:.4f}" for x in r["cpu_ratios"]) + ")")
    print("schedule() cost by requests scheduled in the step, p50 / p99 us (steps):")
    for r in rows:
        print(f"{r['pool']:>7} " + "   ".join(
            f"{b}: {v['p50_us']:.1f} / {v['p99_us']:.1f} ({v['steps']})"
            for b, v in r["sched_cost_by_reqs"].items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        run_worker(args)
    else:
        orchestrate(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
