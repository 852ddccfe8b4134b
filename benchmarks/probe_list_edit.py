"""The probe's handling of a step's list of running requests, wire 4 (the edit) against
wire 3 (the whole list), on vLLM's own lists, in instructions (issue 25, seventeenth pass).

    python benchmarks/probe_list_edit.py [--running 128 256]

For each size, the decode-heavy twin (``decode_feed``, a pool that never preempts) runs
1,200 steps; for the 1,000 after the first 200 it keeps each step's
``scheduled_cached_reqs.req_ids`` and its finished and preempted IDs (the same string
objects vLLM holds). Children under ``valgrind --tool=cachegrind --cache-sim=no`` replay
them through what the probe's step record does with them: compare with the previous
list, copy, and encode the whole list (``v3``), or look for the edit
(``wire.cached_edit``) and encode the IDs appended and the positions (``v4``); five
replays minus one, over 4,000 steps, is the instructions a step. Attribution, never the
live cost: the whole engine's count (``instructions.py``) moves by tens of thousands
between children of one code. A report: a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "exporter"))
sys.path.insert(0, str(HERE))
STEPS, SKIP = 1200, 200


def capture(running: int, path: Path) -> None:
    import decode_feed

    from kvscope.twin.engine import Twin

    twin = Twin(decode_feed.config(running, decode_feed.NO_PREEMPT_POOL), seed=0)
    sched = twin.scheduler
    steps: list[tuple[list[str], set[str], set[str]]] = []
    real = type(sched).schedule

    def schedule(*a: Any, **k: Any) -> Any:
        out = real(sched, *a, **k)
        steps.append((list(out.scheduled_cached_reqs.req_ids), set(out.finished_req_ids),
                      set(out.preempted_req_ids or ())))
        return out

    sched.schedule = schedule
    twin.run(decode_feed.requests(running, STEPS), max_steps=STEPS)
    path.write_bytes(pickle.dumps(steps[SKIP:]))


def replay(mode: str, path: Path, reps: int) -> None:
    import msgspec

    from kvscope_probe import wire

    steps = pickle.loads(path.read_bytes())  # noqa: S301 - the file capture() wrote
    enc = msgspec.msgpack.Encoder()
    for _ in range(reps):
        prev: list[str] | None = None
        for ids, fin, pre in steps:
            if prev is not None and ids == prev:
                continue
            copy = listed = list(ids)
            if mode == "v3":
                prev = copy
                enc.encode(listed)
                continue
            removed = None
            if prev is not None:
                gone = (*fin, *pre) if pre else fin
                removed = wire.cached_edit(prev, ids, gone)
                if removed is not None:
                    listed = copy[len(prev) - len(removed):]
            prev = copy
            enc.encode((listed, removed))


def instructions(mode: str, path: Path, reps: int) -> int:
    err = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, __file__, "--replay", mode, str(path), str(reps)],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"},
    ).stderr
    m = re.search(r"I\s+refs:\s+([\d,]+)", err)
    if m is None:
        raise SystemExit(f"no instruction count in valgrind's output: {err[-500:]}")
    return int(m.group(1).replace(",", ""))


def main() -> None:
    if sys.argv[1:2] == ["--replay"]:
        replay(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--running", type=int, nargs="+", default=[128, 256])
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvscope-list-edit-") as d:
        for running in args.running:
            path = Path(d) / f"lists-{running}.pickle"
            capture(running, path)
            n = STEPS - SKIP
            per = {m: (instructions(m, path, 5) - instructions(m, path, 1)) / (4 * n)
                   for m in ("v3", "v4")}
            rows.append({"running": running, "v3": round(per["v3"]), "v4": round(per["v4"]),
                         "added": round(per["v4"] - per["v3"])})
    print("running   v3 instr/step   v4 instr/step   v4 - v3")
    for r in rows:
        print(f"{r['running']:7d} {r['v3']:15,d} {r['v4']:15,d} {r['added']:+9,d}")
    print(json.dumps({"bench": "probe_list_edit", "rows": rows}))


if __name__ == "__main__":
    main()
