"""What Python's cyclic collector costs the sidecar's ingest path, by collector setting.

    python benchmarks/ingest_gc.py [--frames FILE | --running 256 --steps 6000]
        [--thresholds 700 20000] [--repeats 2] [--instructions] [--short-steps 800]
        [--long-steps 5600] [--out DIR]

``ingest_instructions.py`` replays with the collector paused, so that repeats count the
same; the live sidecar runs it. Here one engine's recorded frames (``ingest_instructions``'s
recording, or ``--frames``) are replayed through the ``Hub`` and the request tracker in a
child process set up as ``kvscope serve`` runs: the store's and the HTTP server's imports
done (pyarrow, pandas, clickhouse-connect, uvicorn), the start-up heap frozen, the young
generation's threshold set to each of ``--thresholds`` (700 is CPython's default,
``kvscope.sidecar.cyclic_gc.GEN0_THRESHOLD`` the sidecar's), the rows kept as the store's
queues keep them (the last ~5 s: a deque of 4,500). Per setting: CPU per ingested step
(natively, caches hot after the first frames), and the collections by generation with
their time per step (``gc.callbacks``). ``--instructions`` also counts each setting under
``valgrind --tool=cachegrind --cache-sim=no``, the frames holding ``--short-steps`` and
``--long-steps`` steps, (long - short) / steps between. A report, never an assertion.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROWS_KEPT = 4500
"""Rows the store's queues hold live at 256 running (~850 a second, sealed every 5 s)."""


def child(path: Path, threshold: int, n: int) -> dict[str, Any]:
    """One replay of the first ``n`` frames with the collector set as given."""
    import clickhouse_connect  # noqa: F401 - what kvscope serve has imported
    import msgspec
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401
    import uvicorn  # noqa: F401
    from ingest_instructions import replay_hub

    frames = msgspec.msgpack.decode(path.read_bytes(), type=list[list[bytes]])[:n]
    rows: deque[Any] = deque(maxlen=ROWS_KEPT)
    hub = replay_hub(rows.append)
    spent = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            s = spent[info["generation"]]
            s[0] += 1
            s[1] += time.perf_counter() - started[0]

    gc.collect()
    gc.freeze()
    gc.set_threshold(threshold, 10, 10)
    gc.callbacks.append(timed)
    t = time.process_time()
    for parts in frames:
        hub.accept(parts)
    cpu = time.process_time() - t
    steps = next(iter(hub.engines.values())).counters.steps
    return {"steps": steps, "cpu_s": cpu,
            "collections": {g: {"n": c, "s": s} for g, (c, s) in spent.items()}}


def run_child(path: Path, threshold: int, n: int, valgrind: Path | None = None
              ) -> dict[str, Any]:
    from ingest_instructions import child_env
    from instructions import VALGRIND, total_ir

    prefix = [*VALGRIND, f"--cachegrind-out-file={valgrind}"] if valgrind else []
    proc = subprocess.run([*prefix, sys.executable, str(Path(__file__)), "--child", str(path),
                           str(threshold), str(n)], env=child_env(ROOT / "exporter"),
                          capture_output=True, text=True, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if valgrind:
        got["ir"] = total_ir(valgrind)
    return got


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
        return
    from ingest_instructions import add_recording_args, decoding_recording, prefixes

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recording_args(p)
    p.add_argument("--thresholds", type=int, nargs="+", default=[700, 20000])
    p.add_argument("--repeats", type=int, default=2, help="native replays per setting")
    p.add_argument("--instructions", action="store_true", help="also under cachegrind")
    p.add_argument("--short-steps", type=int, default=800)
    p.add_argument("--long-steps", type=int, default=5600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-ingest-gc-"))
    out.mkdir(parents=True, exist_ok=True)
    path = decoding_recording(args, out)
    short, long = prefixes(path, args.short_steps, args.long_steps)
    results = []
    print("threshold  us/step  collections by generation (us/step)         instructions/step")
    for _ in range(args.repeats):
        for thr in args.thresholds:
            got = run_child(path, thr, 10**9)
            steps = got["steps"]
            row = {"threshold": thr, "steps": steps, "us_per_step": got["cpu_s"] / steps * 1e6,
                   "collections": got["collections"]}
            results.append(row)
            gens = "  ".join(f"gen{g} {c['n']:4d} ({c['s'] / steps * 1e6:5.2f})"
                             for g, c in got["collections"].items())
            print(f"{thr:9d}  {row['us_per_step']:7.1f}  {gens}")
    if args.instructions:
        for thr in args.thresholds:
            a = run_child(path, thr, short, out / f"cg.{thr}.short")
            b = run_child(path, thr, long, out / f"cg.{thr}.long")
            per = (b["ir"] - a["ir"]) / (b["steps"] - a["steps"])
            young = b["collections"]["0"]["n"] - a["collections"]["0"]["n"]
            results.append({"threshold": thr, "ir_per_step": per, "young_between": young,
                            "steps_between": b["steps"] - a["steps"]})
            print(f"{thr:9d}  under cachegrind: {per / 1e3:.1f} k instructions a step, "
                  f"{young} young collections in {b['steps'] - a['steps']} steps")
    summary = {"bench": "ingest_gc", "frames": str(path), "results": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
