"""How fast ``kvscope whatif`` replays on a user's model: the tiny model's pool against a
32k-context one, side by side in one process.

    python benchmarks/whatif_speed.py [--model Qwen2.5-7B] [--requests 600] [--out DIR]

Three settings of ``kvscope.whatif.measure`` (vLLM's real scheduler with the probe bound and
a sidecar Hub fed, exactly what ``kvscope whatif`` runs), each on a workload drawn to
fill it: ``tiny``, the tiny Llama's pool grown to 6,250 blocks of 16 tokens (about
100,000 tokens of KV) at ``max_model_len`` 4,096; ``32k``, ``--model``'s KV layout at
``max_model_len`` 32,768 on the same pool and the same workload (prompts up to 3k tokens,
~120 running); ``32k long``, the same with prompts up to 24k tokens (a quarter as many
requests, ~20 running: what such a pool holds). All with 256 seats and an 8,192-token
budget. Per setting: steps, requests between admission and end per step (mean; a
preempted one counts), wall seconds of ``measure`` (a twin's setup included), steps per
second; vLLM is imported by a small warm-up run first, not timed. A report, never an
assertion: prints a table and one JSON line (also ``summary.json``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import git_state, machine_noise, write_summary


def settings(model: str, requests: int) -> list[tuple[str, Any, Any]]:
    from kvscope.models.kv_layout import load
    from kvscope.twin import TwinConfig, WorkloadSpec

    common = {"block_size": 16, "num_blocks": 6250, "max_num_seqs": 256,
              "max_num_batched_tokens": 8192}
    served = TwinConfig(max_model_len=32768, **load(model).twin_fields(), **common)
    mixed = WorkloadSpec(n_requests=requests, long_prompt=(300, 3000), max_tokens=(64, 512),
                         waves=8, seed=1)
    long = WorkloadSpec(n_requests=requests // 4, long_prompt=(2000, 24000),
                        short_prompt=(64, 512), max_tokens=(64, 1024), shared_prefix_len=1024,
                        waves=8, seed=1)
    return [("tiny", TwinConfig(max_model_len=4096, **common), mixed),
            ("32k", served, mixed), ("32k long", served, long)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen2.5-7B")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-whatif-speed-"))
    out.mkdir(parents=True, exist_ok=True)

    from kvscope.twin import generate
    from kvscope.whatif.measure import measure

    summary: dict[str, Any] = {"git": git_state(), "noise": machine_noise(), "model": args.model,
                               "runs": []}
    print(f"{'setting':8} {'max_len':>7} {'blocks':>6} {'steps':>6} {'running':>7} "
          f"{'preempt':>7} {'wall s':>7} {'steps/s':>8}")
    from kvscope.twin import TwinConfig, WorkloadSpec

    measure(TwinConfig(), generate(WorkloadSpec(n_requests=8)))  # imports vLLM: not timed
    for name, cfg, spec in settings(args.model, args.requests):
        reqs = generate(spec)
        t0 = time.perf_counter()
        m = measure(cfg, reqs, seed=1)
        wall = time.perf_counter() - t0
        held = sum(r["finished_step"] - r["admitted_step"] for r in m.records
                   if r["finished_step"] is not None and r["admitted_step"] is not None)
        r = {"setting": name, "max_model_len": cfg.max_model_len, "num_blocks": cfg.num_blocks,
             "steps": m.steps, "drained": m.drained, "running_mean": held / m.steps,
             "preemptions": m.preemptions_total, "faults": m.faults, "wall_s": wall,
             "steps_per_s": m.steps / wall}
        summary["runs"].append(r)
        print(f"{name:8} {cfg.max_model_len:7d} {cfg.num_blocks:6d} {m.steps:6d} "
              f"{r['running_mean']:7.1f} {m.preemptions_total:7d} {wall:7.1f} "
              f"{r['steps_per_s']:8.0f}", flush=True)
    write_summary(summary, out)


if __name__ == "__main__":
    main()
