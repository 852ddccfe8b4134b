"""How often Python's cyclic collector runs in the engine process, probe off and on.

    python benchmarks/probe_gc.py [--running 256 128 32] [--steps 3000] [--warm 40]
        [--repeat 1] [--out FILE]

A full (generation 2) collection of vLLM's heap costs the engine hundreds of millions of
instructions (~250 M at 256 running: cachegrind, per function), so whether one falls inside
``instructions.py``'s 100-step window moves its per-step figure by ±2-5 M: more than the
probe's own work. Collections are driven by allocations, not time, so a long native run
(``decode_feed.py``, no valgrind) says whether the probe makes them more frequent: this
counts them per generation over the measured steps, probe off and on (sending to a
process that discards the frames), with the seconds they took. A report, never an
assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import Sink
from decode_feed import NO_PREEMPT_POOL, preempting_pool

HERE = Path(__file__).resolve().parent


def run(running: int, pool: int, warm: int, steps: int, probe: str) -> dict[str, Any]:
    argv = [sys.executable, str(HERE / "decode_feed.py"), "--running", str(running),
            "--pool", str(pool), "--warm", str(warm), "--steps", str(steps)]
    if probe:
        argv += ["--probe", probe, "--engine", f"gc-{running}-{pool}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    env.update({"VLLM_LOGGING_LEVEL": "ERROR", "OMP_NUM_THREADS": "1",
                "OPENBLAS_NUM_THREADS": "1"})
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--running", type=int, nargs="+", default=[256, 128, 32])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warm", type=int, default=40)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvscope-gc-"))
    sink = Sink(f"ipc://{work}/sink.sock")
    sink.start()
    rows = []
    print(f"{'running':>7} {'pool':>6} {'probe':>5} {'preempts':>8} {'gen0':>6} {'gen1':>5} "
          f"{'gen2':>5} {'gen2 ms each':>12} {'ms/step':>8}")
    try:
        for running in args.running:
            for pool in (NO_PREEMPT_POOL, preempting_pool(running)):
                for probe in ("", sink.endpoint):
                    for _ in range(args.repeat):
                        r = run(running, pool, args.warm, args.steps, probe)
                        c, s = r["collections"], r["collection_s"]
                        row = {"running": running, "pool": pool, "probe": bool(probe), **r}
                        rows.append(row)
                        each = 1e3 * s[2] / c[2] if c[2] else 0.0
                        print(f"{running:7d} {pool:6d} {'on' if probe else 'off':>5} "
                              f"{r['preemptions']:8d} {c[0]:6d} {c[1]:5d} {c[2]:5d} "
                              f"{each:12.1f} {1e3 * r['wall_s'] / r['steps']:8.2f}",
                              flush=True)
    finally:
        sink.stop()
    summary = {"steps": args.steps, "warm": args.warm, "rows": rows}
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
