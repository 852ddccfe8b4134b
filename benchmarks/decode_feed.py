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
import gc
import json
import os
import sys
import time
from typing import Any

BLOCK = 16
NO_PREEMPT_POOL = 32768
HOLD_STEPS = 640
FLOOR_DRAIN = 64


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
               interval_s: float = 0.0, collector: bool = True,
               floor: bool = False, need: bool = True) -> dict[str, Any]:
    """``collector=False``: Python's cyclic collector paused from the first measured step
    (after ``warm``) for the rest of the process (see ``Collections``): the children of
    ``fork_runs`` exit right after. Enabled again, it ran what the window had deferred,
    still inside the child that cachegrind counts (a full collection, ~250 M instructions,
    in one child of a pair and not the other). ``floor``: the floor's hooks
    (``micro_floor.install_floor``, installed by the caller) record this twin; its ring is
    emptied every FLOOR_DRAIN steps (the floor has no sender). ``need=False``: the probe's
    blocks-needed hook is never armed (attribution: what it costs; its preemptions then
    carry no blocks-needed figure)."""
    from kvscope.twin.engine import Twin

    twin = Twin(config(running, pool), seed=0)
    if not need:  # the probe attached at the scheduler's creation: never arm its hook
        from kvscope_probe.needhook import arm

        probe = twin.scheduler._kvscope
        probe.arm_below = -1
        arm(probe, False)
    rec: Any = None
    if floor:
        from micro_floor import FloorRecorder

        rec = FloorRecorder(twin.scheduler)
        twin.scheduler._kvscope = rec.pool._kvscope = rec
    reqs = requests(running, warm + steps)
    seats: list[int] = []
    if wait:
        print("READY", flush=True)
        sys.stdin.readline()
    gcs = Collections()
    if warm == 0:
        gcs.start(collector)
    gc.callbacks.append(gcs)

    def on_step(i: int, _out: Any) -> None:
        seats.append(len(twin.scheduler.running))
        if rec is not None and i % FLOOR_DRAIN == 0:
            rec.ring.clear()
        if i + 1 == warm:
            gcs.start(collector)

    t0 = time.perf_counter()
    try:
        res = twin.run(reqs, max_steps=warm + steps, step_interval_s=interval_s,
                       on_step=on_step)
    finally:
        gc.callbacks.remove(gcs)
    wall = time.perf_counter() - t0
    measured = seats[warm:] or [0]
    return {"steps": res.steps, "preemptions": res.preemptions, "wall_s": wall,
            "running_min": min(measured), "running_max": max(measured),
            "running_mean": sum(measured) / len(measured), "collections": gcs.counts,
            "collection_s": [round(x, 6) for x in gcs.seconds],
            **({"floor_records": rec.seq} if rec is not None else {})}


class Collections:
    """Python's cyclic collections by generation, counted from the first measured step
    (``counting``): a full (generation 2) collection of vLLM's heap costs hundreds of
    millions of instructions, so whether one falls inside a window moves that window's
    figure more than the probe does. Deterministic for a given allocation sequence."""

    def __init__(self) -> None:
        self.counting = False
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def start(self, collector: bool) -> None:
        """The first measured step: count from here; pause the collector unless asked."""
        self.counting = True
        if not collector:
            gc.disable()

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if not self.counting:
            return
        if phase == "start":
            self.counts[info["generation"]] += 1
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0


def load_probe(endpoint: str) -> None:
    os.environ["KVSCOPE_PROBE_ENDPOINT"] = endpoint
    from vllm.plugins import load_general_plugins

    load_general_plugins()


def stop_probe() -> None:
    from kvscope_probe import plugin

    plugin.stop_all()


def fork_runs(jobs: list[dict[str, Any]], wait: bool) -> None:
    """One child per job, forked after vLLM is imported (see the module doc); each job:
    running, pool, warm, steps, probe (endpoint or ""), tag; ``floor`` (optional): the
    floor's hooks instead of the probe (``micro_floor.install_floor``); ``need`` (optional,
    default true): false never arms the probe's blocks-needed hook."""
    import kvscope.twin.engine  # noqa: F401 - the setup every child shares

    # Building a scheduler imports ~250 more modules (opentelemetry, grpc, vllm.v1.executor,
    # ...): a tiny run here does it once for every child. Done in the first child instead,
    # it compiled what had no .pyc yet, which the next children loaded from disk: ~100 M
    # instructions of parsing in one child alone moved one pair's figure by 5 M a step.
    run_engine(8, 400, 0, 60, False)

    if wait:  # until the receivers are up
        print("READY", flush=True)
        sys.stdin.readline()
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            if job["probe"]:
                os.environ["KVSCOPE_ENGINE"] = job["tag"]
                load_probe(job["probe"])
            if job.get("floor"):
                from micro_floor import install_floor

                install_floor()
            out = run_engine(job["running"], job["pool"], job["warm"], job["steps"], False,
                             job.get("interval", 0.0), job.get("collector", True),
                             bool(job.get("floor")), job.get("need", True))
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
