"""What a layout sample costs: the sampler's tick, and reading the sample it kept.

    python benchmarks/layout_tick.py [--frames FILE | --running 256 --steps 6000]
        [--ticks 40] [--rest 0 1] [--against CHECKOUT] [--out DIR]

One engine's recording (``ingest_instructions.py``'s: frames as the probe sent them) is
replayed through the ``Hub`` in a fresh process per checkout and ``--rest``, all but its
last ``--ticks`` frames at once; then, for each of those, the frame is ingested, the
thread rests ``REST`` seconds (0: caches hot; 1: as the sampler's thread runs, once a
second), and a ``LayoutSampler.tick`` samples the pool (timed), then the new sample's
runs and owners are read as storing it or showing it does (timed apart: ``read``). A
sampler keeps one sample a second and the store one a minute, so the tick is the
per-second cost and the read is paid for the few samples that are shown or stored.
Reported per checkout: the least and the median thread CPU of each (``time.thread_time``),
the bytes each sample adds to the sampler's history before and after it is read, and the
runs, free blocks and longest free run of the last sample (the same in every checkout).
A report, never an assertion.
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

import msgspec

HERE = Path(__file__).resolve().parent


def child(path: Path, ticks: int, rest_s: float) -> dict[str, Any]:
    from ingest_instructions import replay_hub

    from kvscope.layout.sampler import LayoutSampler

    frames = msgspec.msgpack.decode(path.read_bytes(), type=list[list[bytes]])
    hub = replay_hub()
    for parts in frames[:-ticks]:
        hub.accept(parts)
    sampler = LayoutSampler(hub, history=10_000, history_bytes=1 << 40)
    tick_us, read_us, kept, grown = [], [], [], []
    for i, parts in enumerate(frames[-ticks:]):
        hub.accept(parts)
        if rest_s:
            time.sleep(rest_s)
        t = time.thread_time_ns()
        (snap,) = sampler.tick(now=float(i))
        tick_us.append((time.thread_time_ns() - t) / 1e3)
        held = sampler._bytes[snap.key]
        t = time.thread_time_ns()
        runs = snap.runs
        owners = list(snap.owners)
        read_us.append((time.thread_time_ns() - t) / 1e3)
        kept.append(snap.cost)
        grown.append(sampler._bytes[snap.key] - held)
    return {"tick_us": tick_us, "read_us": read_us, "bytes_kept": kept, "bytes_read": grown,
            "runs": int(runs.shape[0]), "owners": len(owners), "free": snap.free_blocks,
            "longest_free": snap.max_contiguous_free, "num_blocks": snap.num_blocks}


def run(checkout: Path, path: Path, ticks: int, rest_s: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout / "exporter"), "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, __file__, "--child", str(path), str(ticks),
                           str(rest_s)], env=env, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from ingest_instructions import add_recording_args, decoding_recording

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recording_args(p)
    p.add_argument("--ticks", type=int, default=40)
    p.add_argument("--rest", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--against", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-layout-tick-"))
    out.mkdir(parents=True, exist_ok=True)
    path = decoding_recording(args, out)
    checkouts = [("this", HERE.parent)] + ([("against", args.against)] if args.against else [])
    rows = []
    print(f"{'code':8} {'rest s':>6} {'tick us min/med':>16} {'read us min/med':>16} "
          f"{'kept B':>8} {'read B':>8} {'runs':>6} {'free':>7} {'longest':>7}")
    for rest_s in args.rest:
        for name, checkout in checkouts:
            r = run(checkout, path, args.ticks, rest_s)
            ticks, reads = sorted(r["tick_us"]), sorted(r["read_us"])
            row = {"code": name, "checkout": str(checkout), "rest_s": rest_s, **r,
                   "tick_min": ticks[0], "tick_median": ticks[len(ticks) // 2],
                   "read_min": reads[0], "read_median": reads[len(reads) // 2]}
            rows.append(row)
            print(f"{name:8} {rest_s:6.2f} {ticks[0]:7.0f}/{row['tick_median']:<8.0f} "
                  f"{reads[0]:7.0f}/{row['read_median']:<8.0f} {r['bytes_kept'][-1]:8d} "
                  f"{r['bytes_read'][-1]:8d} {r['runs']:6d} {r['free']:7d} "
                  f"{r['longest_free']:7d}", flush=True)
    summary = {"bench": "layout_tick", "frames": str(path), "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))))
    else:
        main()
