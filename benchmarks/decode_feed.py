"""The decode-heavy engine the live and instruction benchmarks drive: vLLM's real scheduler
(the twin) with no model, 16-token blocks, and enough short-prompt, long-output requests
arriving to keep ``running`` seats busy.

Run as a script it is one engine process: with ``--probe`` it loads the probe the way
vLLM loads plugins (``KVSCOPE_PROBE_ENDPOINT`` set, then
``vllm.plugins.load_general_plugins()``), builds the twin, prints ``READY``, waits for a
line on stdin (``--wait``) and steps ``--warm + --steps`` times, then prints one JSON line.
``--jobs JSON`` (the instruction benchmark, under valgrind): vLLM is imported once, then
one child per job is forked; children of the same engine settings run the same seeded
schedule, and the parent's setup, the same in every child, cancels in their differences.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

BLOCK = 16
NO_PREEMPT_POOL = 32768
HOLD_STEPS = 640


def config(running: int, pool: int) -> Any:
    from kvscope.twin import TwinConfig

    return TwinConfig(block_size=BLOCK, num_blocks=pool, max_num_seqs=running,
                      max_num_batched_tokens=8192, max_model_len=4096, policy="fcfs",
                      enable_prefix_caching=True)


def preempting_pool(running: int) -> int:
    """A pool about 40% of what ``running`` decode-heavy requests grow to: it preempts
    once the batch has grown (prompts 128-512, outputs 256-1024 tokens: ~60 blocks each)."""
    return max(256, running * 24)


def requests(running: int, steps: int) -> list[Any]:
    """``running`` requests at step 0, then one every ``HOLD_STEPS / running`` steps: a
    request holds its seat for about HOLD_STEPS steps (outputs 256-1024 tokens), so the
    seats stay about full, decoding, with a few prefills a step."""
    from dataclasses import replace

    from kvscope.twin import WorkloadSpec, generate

    n = running + running * steps // HOLD_STEPS + 16
    reqs = generate(WorkloadSpec(
        n_requests=n, short_fraction=1.0, short_prompt=(128, 512), long_prompt=(128, 512),
        shared_prefix_fraction=0.0, shared_prefix_len=0, max_tokens=(256, 1024),
        waves=1, wave_interval_steps=1, priorities=(0, 0), seed=0))
    return [replace(r, arrival_step=max(0, (k - running) * HOLD_STEPS // running))
            for k, r in enumerate(reqs)]


def run_engine(running: int, pool: int, warm: int, steps: int, wait: bool,
               interval_s: float = 0.0) -> dict[str, Any]:
    from kvscope.twin.engine import Twin

    twin = Twin(config(running, pool), seed=0)
    reqs = requests(running, warm + steps)
    seats: list[int] = []
    if wait:
        print("READY", flush=True)
        sys.stdin.readline()
    t0 = time.perf_counter()
    res = twin.run(reqs, max_steps=warm + steps, step_interval_s=interval_s,
                   on_step=lambda i, o: seats.append(len(twin.scheduler.running)))
    wall = time.perf_counter() - t0
    measured = seats[warm:] or [0]
    return {"steps": res.steps, "preemptions": res.preemptions, "wall_s": wall,
            "running_min": min(measured), "running_max": max(measured),
            "running_mean": sum(measured) / len(measured)}


def load_probe(endpoint: str) -> None:
    os.environ["KVSCOPE_PROBE_ENDPOINT"] = endpoint
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def stop_probe() -> None:
    from kvscope_probe import plugin

    plugin.stop_all()


def fork_runs(jobs: list[dict[str, Any]], wait: bool) -> None:
    """One child per job, forked after vLLM is imported (see the module doc); each job:
    running, pool, warm, steps, probe (endpoint or ""), tag."""
    import kvscope.twin.engine  # noqa: F401 - the setup every child shares

    if wait:  # until the receivers are up
        print("READY", flush=True)
        sys.stdin.readline()
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            if job["probe"]:
                os.environ["KVSCOPE_ENGINE"] = job["tag"]
                load_probe(job["probe"])
            out = run_engine(job["running"], job["pool"], job["warm"], job["steps"], False,
                             job.get("interval", 0.0))
            if job["probe"]:
                stop_probe()
            print(json.dumps({"job": job, "pid": os.getpid(), **out}), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--pool", type=int, default=NO_PREEMPT_POOL)
    p.add_argument("--warm", type=int, default=200)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--probe", default="", help="probe endpoint; empty: probe off")
    p.add_argument("--engine", default="")
    p.add_argument("--wait", action="store_true")
    p.add_argument("--jobs", default="", help="JSON list of jobs to fork (see fork_runs)")
    p.add_argument("--interval", type=float, default=0.0, help="seconds between steps")
    p.add_argument("--hold-s", type=float, default=0.0,
                   help="after the run, print its result and stay connected, idle, this long")
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.engine:
        os.environ["KVSCOPE_ENGINE"] = args.engine
    if args.jobs:
        fork_runs(json.loads(args.jobs), args.wait)
        return
    if args.probe:
        load_probe(args.probe)
    out = run_engine(args.running, args.pool, args.warm, args.steps, args.wait, args.interval)
    if args.hold_s:  # an idle engine: its requests stay, no step, the probe heartbeats
        print(json.dumps(out), flush=True)
        time.sleep(args.hold_s)
    if args.probe:
        stop_probe()
    if not args.hold_s:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
