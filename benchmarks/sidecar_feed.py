"""A real ``kvscope serve`` fed one engine's recorded frames, with no engine running.

    python benchmarks/sidecar_feed.py [--frames FILE | --running 256 --steps 6000]
        [--paces 185 0] [--group 1] [--variant off] [--rounds 2] [--spin] [--pin CPU]
        [--layout-interval S] [--against CHECKOUT] [--out DIR]

``sidecar_live.py`` measures the sidecar beside the engines that feed it; this sends the
frames a probe sent (recorded once by ``ingest_instructions.record``: one engine at
``--running``, the probe's own batching, ~23 steps a frame at 256 running) from this
process over ipc at ``--paces`` engine steps a second (0: all at once), so what the
sidecar costs live is measured without engine processes sharing the machine, and can be
set beside a hot replay of the same frames (``ingest_instructions.py --native``).

Per pace and round, this checkout's sidecar then ``--against``'s (alternated): every
thread's CPU from ``/proc/<pid>/task/*/schedstat`` (nanoseconds the scheduler ran it:
exact, where ``stat``'s ticks are 10 ms), its kernel share and minor page faults from
``stat``, per ingested step, over the frames after the first (the engine's hello and
keyframe) until the sidecar reports the last step (polled every 0.5 s; its idle CPU over
that tail, a few ms, is not subtracted). ``--spin`` runs a ``nice 19`` busy loop on the
sidecar's CPU (``--pin``, 1 by default; the sidecar's threads and this feeder are pinned
apart), so that CPU never idles between frames: what the sidecar's threads pay for
waking on an idle virtual CPU.
A report, never an assertion: prints a table and one JSON line (also ``summary.json``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
from _common import Sidecar, git_state, machine_noise, wait_engine_steps, write_summary
from sidecar_live import VARIANTS, by_thread_name, os_threads

from kvscope.procs import stop_process
from kvscope.sidecar.exposition.own_cpu import thread_cpu_ns
from kvscope_probe import wire


def schedstat(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread's name and CPU seconds so far, from the scheduler's nanoseconds (read
    by name with ``sidecar_live.by_thread_name``; what the sidecar's own metric reads)."""
    return {tid: (name, ns / 1e9)
            for tid, (name, ns) in thread_cpu_ns(Path(f"/proc/{pid}")).items()}


def steps_in(parts: list[bytes]) -> int:
    return sum(type(r) is wire.Step for r in wire.decode(parts).records)


def feed(args: argparse.Namespace, frames: list[list[bytes]], counts: list[int],
         pace: float, work: Path, label: str, src: Path | None) -> dict[str, Any]:
    vdir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work))
    (vdir / "run").mkdir()
    endpoint = f"ipc://{vdir}/run/probe.sock"
    env = {"PYTHONPATH": f"{src}/exporter"} if src else {}
    if args.layout_interval is not None:
        env["KVSCOPE_LAYOUT_INTERVAL_S"] = str(args.layout_interval)
    side = Sidecar(endpoint, vdir / "sidecar.log", VARIANTS[args.variant](vdir), env=env)
    side.start(60.0)
    spin = None
    sock = zmq.Context.instance().socket(zmq.PUSH)
    try:
        if args.spin or args.pin is not None:
            cpu = str(1 if args.pin is None else args.pin)
            subprocess.run(["taskset", "-a", "-p", "-c", cpu, str(side.pid)], check=True,
                           stdout=subprocess.DEVNULL)
        if args.spin:
            spin = subprocess.Popen(["taskset", "-c", cpu, "nice", "-n", "19", sys.executable,
                                     "-c", "while True: pass"], start_new_session=True)
        sock.connect(endpoint)
        time.sleep(args.settle_s)
        sock.send_multipart(frames[0])  # hello and keyframe: left out
        time.sleep(1.0)
        c0, s0, t0 = schedstat(side.pid), os_threads(side.pid), time.monotonic()
        due = t0
        for i, (parts, n) in enumerate(zip(frames[1:], counts[1:], strict=True), 1):
            sock.send_multipart(parts)
            due += n / pace if pace > 0 else 0.0
            if pace > 0 and i % args.group == 0:
                time.sleep(max(0.0, due - time.monotonic()))
        seen = wait_engine_steps(side.url, args.engine, sum(counts), 120.0)
        c1, s1, t1 = schedstat(side.pid), os_threads(side.pid), time.monotonic()
    finally:
        sock.close(linger=0)
        if spin is not None:
            stop_process(spin, 5, group=True)
        side.stop()
    steps = sum(counts[1:])
    cpu = by_thread_name(c0, c1, side.pid)
    return {
        "sidecar": label, "pace": pace, "group": args.group, "spin": args.spin, "steps": steps,
        "wall_s": t1 - t0, "us_per_step": sum(cpu.values()) / steps * 1e6,
        "us_per_step_by_thread": {k: v / steps * 1e6 for k, v in cpu.items()},
        "kernel_cpu_s_by_thread": by_thread_name(s0, s1, side.pid, 2),
        "minor_faults_by_thread": by_thread_name(s0, s1, side.pid, 3),
        "ingested": (seen or {}).get("steps", 0),
        "mismatches": (seen or {}).get("ledger_mismatches", -1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--frames", type=Path, default=None, help="a recording to send")
    p.add_argument("--running", type=int, default=256, help="recording: seats")
    p.add_argument("--steps", type=int, default=6000, help="recording: engine steps")
    p.add_argument("--paces", type=float, nargs="+", default=[185.0, 0.0],
                   help="engine steps a second sent (0: as fast as the socket takes them)")
    p.add_argument("--variant", default="off", choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--group", type=int, default=1,
                   help="send frames this many at a time, the pace kept on average")
    p.add_argument("--spin", action="store_true")
    p.add_argument("--pin", type=int, default=None, help="the sidecar's CPU")
    p.add_argument("--layout-interval", type=float, default=None,
                   help="the sidecar's layout sampler interval (3600: out of the window)")
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--against", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvscope-feed-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    path = args.frames
    if path is None:
        from ingest_instructions import record

        path = out / "frames.msgpack"
        rec = argparse.Namespace(running=args.running, preempt=False, pool=0, warm=50,
                                 steps=args.steps, interval=0.0)
        print(f"recording {record(rec, path)} frames to {path}", file=sys.stderr)
    frames = msgspec.msgpack.decode(path.read_bytes(), type=list[list[bytes]])
    counts = [steps_in(f) for f in frames]
    args.engine = next(r.engine for r in wire.decode(frames[0]).records
                       if type(r) is wire.Hello)
    if args.spin or args.pin is not None:
        os.sched_setaffinity(0, {0 if (args.pin or 1) != 0 else 1})
    srcs: dict[str, Path | None] = {"this": None}
    if args.against is not None:
        srcs["against"] = args.against
    os.environ.pop("PYTHONPATH", None)
    summary: dict[str, Any] = {"git": git_state(), "noise": machine_noise(), "frames": str(path),
                               "variant": args.variant, "runs": []}
    print(f"{'sidecar':8} {'pace':>5} {'steps':>6} {'us/step':>8}  by thread (us/step)")
    for _ in range(args.rounds):
        for pace in args.paces:
            for label, src in srcs.items():
                r = feed(args, frames, counts, pace, work, label, src)
                summary["runs"].append(r)
                threads = ", ".join(f"{k} {v:.1f}" for k, v in r["us_per_step_by_thread"].items()
                                    if v >= 0.5)
                print(f"{label:8} {pace:5.0f} {r['steps']:6d} {r['us_per_step']:8.1f}  {threads}"
                      f"  (ingested {r['ingested']}, {r['mismatches']} mismatches)", flush=True)
    write_summary(summary, out)


if __name__ == "__main__":
    main()
