"""One engine's layout snapshot (what the sidecar's layout thread builds once a second per
engine), glibc's default heap thresholds against ``kvscope.heap``'s, side by side.

    python benchmarks/layout_snapshot.py [--running 32] [--pool 131072] [--interval 0.01]
        [--frames FILE] [--snapshots 400]

The pool is a real one: ``ingest_instructions.record`` runs one engine (``decode_feed.py``:
vLLM's real scheduler, no model, the probe loaded) and keeps its frames (``--frames``
replays a recording kept before); they are replayed into a ``Hub``, and then, in a fresh
process per variant, ``EngineCopy.of`` and ``build_snapshot`` run ``--snapshots`` times
after 20 unmeasured: user and kernel CPU, wall time and minor page faults per snapshot
(``getrusage``). ``default``: glibc as the process starts; ``kept``: after
``kvscope.heap.keep_freed_buffers()``, as ``kvscope serve`` runs. A report, never an
assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("default", "kept")


def child(variant: str, frames_path: Path, snapshots: int) -> dict[str, Any]:
    import msgspec

    import ingest_instructions
    import kvscope.state.engine as engine_module
    from kvscope.heap import keep_freed_buffers
    from kvscope.layout.snapshot import EngineCopy, build_snapshot
    from kvscope.state.hub import Hub

    kept = keep_freed_buffers() if variant == "kept" else False
    frames = msgspec.msgpack.decode(frames_path.read_bytes(), type=list[list[bytes]])
    hub = Hub(health_timeout_s=1e9)
    engine_module.time = ingest_instructions._StepClock(hub)
    for parts in frames:
        hub.accept(parts)
    st = next(iter(hub.engines.values()))
    for _ in range(20):
        snap = build_snapshot(EngineCopy.of(st), 0.0)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(snapshots):
        snap = build_snapshot(EngineCopy.of(st), 0.0)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    return {"variant": variant, "kept": kept, "blocks": snap.num_blocks,
            "runs": len(snap.runs), "owners": len(snap.owners),
            "user_us": (r1.ru_utime - r0.ru_utime) / snapshots * 1e6,
            "sys_us": (r1.ru_stime - r0.ru_stime) / snapshots * 1e6,
            "wall_us": (t1 - t0) / snapshots * 1e6,
            "minflt": (r1.ru_minflt - r0.ru_minflt) / snapshots}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))))
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=32)
    p.add_argument("--pool", type=int, default=131072)
    p.add_argument("--interval", type=float, default=0.01)
    p.add_argument("--frames", type=Path, default=None, help="replay this recording")
    p.add_argument("--snapshots", type=int, default=400)
    args = p.parse_args()
    path = args.frames
    if path is None:
        import ingest_instructions

        path = Path(tempfile.mkdtemp(prefix="kvscope-layout-snap-")) / "frames.msgpack"
        rec = argparse.Namespace(running=args.running, preempt=False, pool=args.pool,
                                 interval=args.interval, warm=50, steps=800)
        ingest_instructions.record(rec, path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    rows = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--child", variant, str(path),
                              str(args.snapshots)], env=env, capture_output=True, text=True,
                             check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'variant':<8} {'blocks':>7} {'runs':>5} {'user us':>8} {'sys us':>7} "
          f"{'wall us':>8} {'faults':>7}")
    for r in rows:
        print(f"{r['variant']:<8} {r['blocks']:>7} {r['runs']:>5} {r['user_us']:>8.0f} "
              f"{r['sys_us']:>7.0f} {r['wall_us']:>8.0f} {r['minflt']:>7.1f}")
    print(json.dumps({"bench": "layout_snapshot", "frames": str(path), "rows": rows}))


if __name__ == "__main__":
    main()
