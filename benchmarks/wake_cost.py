"""What a rest before work costs: one engine's frames replayed in one thread, with rests.

    python benchmarks/wake_cost.py [--frames FILE | --running 256 --steps 6000]
        [--takes 0:1 0.1:1 0.25:3 0.5:6 1:12] [--rounds 2] [--spin] [--out DIR]

The recording (``ingest_instructions.py``'s: frames as the probe sent them) is replayed
through the ``Hub`` and the request tracker, as ``ingest_instructions.py``'s ``full`` mode
does (rows built and kept, the last 10,000-20,000 only), in a fresh process per setting,
on its main thread and nowhere else: no sockets, no other sidecar thread, no engine.
Each ``REST:GROUP`` sleeps ``REST`` seconds before every ``GROUP`` frames (``0:1``: back
to back), as the sidecar's ingest thread takes the frames that arrived while its socket
thread rested (``receiver.TAKE_EVERY_S``; a probe sends a frame every 0.1 s, ~23-30 steps of a busy
engine at 256 running). Reported: the thread's CPU (``time.thread_time``) while ingesting,
per step; the rests are not in it. ``--spin`` busy-waits instead of sleeping (the CPU
never idles; another thread's work would evict caches more). The same code on the same
frames: what differs between the settings is only how long the thread rested before
its work. A report, never an assertion.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent


def replay(frames: list[list[bytes]], rest_s: float, group: int, spin: bool) -> dict[str, Any]:
    from ingest_instructions import replay_hub

    gc.disable()
    rows: list[Any] = []
    hub = replay_hub(rows.append)
    cpu = 0.0
    for i in range(0, len(frames), group):
        if rest_s > 0:
            if spin:
                until = time.perf_counter() + rest_s
                while time.perf_counter() < until:
                    pass
            else:
                time.sleep(rest_s)
        t = time.thread_time()
        for parts in frames[i:i + group]:
            hub.accept(parts)
        cpu += time.thread_time() - t
        if len(rows) > 20_000:
            del rows[:10_000]
    gc.enable()
    st = next(iter(hub.engines.values()))
    return {"rest_s": rest_s, "group": group, "spin": spin, "steps": st.counters.steps,
            "us_per_step": cpu / st.counters.steps * 1e6,
            "mismatches": st.counters.ledger_mismatches}


def main() -> None:
    from ingest_instructions import add_recording_args, decoding_recording

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recording_args(p)
    p.add_argument("--takes", nargs="+", default=["0:1", "0.1:1", "0.25:3", "0.5:6", "1:12"],
                   help="REST:GROUP, seconds of rest before every GROUP frames")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spin", action="store_true", help="busy-wait instead of sleeping")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-wake-"))
    out.mkdir(parents=True, exist_ok=True)
    path = decoding_recording(args, out)
    takes = [(float(r), int(g)) for r, g in (t.split(":") for t in args.takes)]
    rows = []
    print(f"{'rest s':>6} {'group':>5} {'steps':>6} {'us/step':>8}")
    for _ in range(args.rounds):
        for rest_s, group in takes:
            row = json.loads(subprocess.run(
                [sys.executable, __file__, "--child", str(path), str(rest_s), str(group),
                 str(int(args.spin))], check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{rest_s:6.2f} {group:5d} {row['steps']:6d} {row['us_per_step']:8.1f}",
                  flush=True)
    summary = {"bench": "wake_cost", "frames": str(path), "spin": args.spin, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


def child(path: Path, rest_s: float, group: int, spin: bool) -> dict[str, Any]:
    frames = msgspec.msgpack.decode(path.read_bytes(), type=list[list[bytes]])
    return replay(frames, rest_s, group, spin)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        print(json.dumps(child(Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]),
                               sys.argv[5] == "1")))
    else:
        main()
