"""The sidecar's ingest path in instructions, on a recorded stream: attribution and floor.

    python benchmarks/ingest_instructions.py [--running 256] [--preempt] [--pool N] [--interval S]
        [--warm 50] [--steps 800] [--short-steps 150] [--long-steps 850] [--frames FILE]
        [--against CHECKOUT ...] [--native N] [--out DIR]

One engine (``decode_feed.py``: vLLM's real scheduler, no model) runs with the probe
loaded, sending to this process, which keeps every frame as received (``frames.msgpack``
in the output directory; ``--frames`` replays a file kept before instead). The frames are
then replayed under ``valgrind --tool=cachegrind --cache-sim=no``, each mode in its own
process, the fewest first frames that hold ``--short-steps`` steps and those that hold
``--long-steps`` (the probe's default pace: a frame every 0.1 s): (long - short) / (steps
between) is the mode's instructions per ingested engine step, import and setup cancelled.

- ``full``: the ``Hub`` and the request tracker, as ``kvscope serve``'s ingest thread runs
  them (rows built and kept in a list, not sent: the store's side is not in it);
- ``hub``: the ``Hub`` alone (ledger, counters, rollups, audits; no request rows);
- ``floor``: what any reader of this wire must do per step to keep each running
  request's token counts readable: decode the frame, keep the step's lists as decoded
  with each request's position (built once per new list: a decoding engine sends "the
  same list" step after step), and move the counts of the requests a new list leaves out
  into two dictionaries. Nothing kvscope reports is built;
- ``decode``: the floor's decode alone.

Repeats are identical (same count to the instruction): the children run with
``PYTHONHASHSEED=0`` (string hashes are seeded per process), ``OPENBLAS_NUM_THREADS=1``
(OpenBLAS's idle threads spin for as long as a run takes), the collector paused, and
``kvscope.state.engine`` reads the recorded steps' times for its clock (it samples the
longest free run at most every 0.1 s, and a replay runs faster than the engine did).
Record at the pace to attribute: ``--interval 0.01`` is issue 25's fleet engine (at most
100 steps a second; 32 running, ``--pool 131072``).

``--native N`` (5 by default) also runs each replay without valgrind, N times in one
process, and reports the least CPU time's (long - short) / steps: cachegrind counts every
iteration of ``rep movs``/``rep stos`` (glibc's memcpy and memset of large buffers: one
instruction a byte) and numpy's vectorised loops retire several instructions a cycle, so
code that moves a pool's bytes reads dearer in instructions than it runs.

A replay is attribution, never the live cost: the frames are decoded by one process with
hot caches, without the receiver, HTTP, the layout sampler or the store around it
(``sidecar_live.py`` measures those). ``--against`` replays the same frames through other
checkouts' ``exporter/`` (which must read this probe's wire version) beside this one's.
A report, never an assertion: prints a table and one JSON line (also ``summary.json``).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("full", "hub", "floor", "decode")


# -- recording ---------------------------------------------------------------------------
def record(args: argparse.Namespace, path: Path) -> int:
    """Run one engine with the probe sending to a socket here; keep every frame."""
    import zmq
    from decode_feed import NO_PREEMPT_POOL, preempting_pool
    from instructions import QUIET_ENV

    quiet = {k: v for k, v in QUIET_ENV.items() if not k.startswith("KVSCOPE_")}
    sock_dir = tempfile.mkdtemp(prefix="kvscope-ingest-")
    atexit.register(shutil.rmtree, sock_dir, True)
    endpoint = f"ipc://{sock_dir}/probe.sock"
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.bind(endpoint)
    pool = args.pool or (preempting_pool(args.running) if args.preempt else NO_PREEMPT_POOL)
    env = {**os.environ, **quiet, "PYTHONPATH": str(ROOT / "exporter")}  # the probe's pace
    engine = subprocess.Popen(
        [sys.executable, str(HERE / "decode_feed.py"), "--running", str(args.running),
         "--pool", str(pool), "--warm", str(args.warm), "--steps", str(args.steps),
         "--interval", str(args.interval), "--probe", endpoint], env=env, stdout=subprocess.DEVNULL)
    frames: list[list[bytes]] = []
    quiet_since = None
    try:
        while True:
            if sock.poll(500):
                frames.append(sock.recv_multipart())
                quiet_since = None
            elif engine.poll() is not None:  # exited: its last frames came before it did
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 2.0:
                    break
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.wait()
        sock.close(linger=0)
    if engine.returncode != 0:
        raise SystemExit(f"the engine exited with {engine.returncode}")
    path.write_bytes(msgspec.msgpack.encode(frames))
    return len(frames)


# -- replay (the child, under valgrind) --------------------------------------------------
class _StepClock:
    """Stands in for ``time`` in ``kvscope.state.engine``: the engine's time at the last
    step ingested, so what the sidecar does per interval of time (the longest free run,
    sampled at most every 0.1 s) falls on the steps it fell on live."""

    def __init__(self, hub: Any) -> None:
        self.hub = hub

    def monotonic(self) -> float:
        for st in self.hub.engines.values():
            return st.last_step.ts if st.last_step is not None else 0.0
        return 0.0

    time = monotonic


def replay_hub(emit: Any = None) -> Any:
    """A ``Hub`` as a replay reads the recording: its clock the recorded steps' times and,
    with ``emit``, the request tracker emitting its rows to it."""
    import kvscope.state.engine as engine_module
    from kvscope.state.hub import Hub
    from kvscope.state.requests import RequestTracker

    hub = Hub(health_timeout_s=1e9)
    engine_module.time = _StepClock(hub)  # type: ignore[assignment]
    if emit is not None:
        hub.listeners.append(RequestTracker(emit).on_event)
    return hub


def replay(mode: str, path: Path, n: int) -> dict[str, Any]:
    gc.disable()
    frames = msgspec.msgpack.decode(path.read_bytes(), type=list[list[bytes]])[:n]
    if mode in ("floor", "decode"):
        return replay_floor(frames, keep=mode == "floor")
    rows: list[Any] = []
    hub = replay_hub(rows.append if mode == "full" else None)
    for parts in frames:
        hub.accept(parts)
    st = next(iter(hub.engines.values()))
    return {"steps": st.counters.steps, "rows": len(rows), "synced": st.ledger.synced,
            "mismatches": st.counters.ledger_mismatches, "rejected": sum(hub.rejected.values())}


def replay_floor(frames: list[list[bytes]], keep: bool) -> dict[str, Any]:
    """Decode; with ``keep``, each scheduled request's computed and scheduled tokens kept
    readable by request, the least way known: the latest step's lists as decoded, each
    request's position in them built once per new list (moved from the first request
    taken out when the probe sends the list as an edit of the one before), and the counts
    of the requests a new list leaves out moved into two dictionaries
    (``kvscope.state.token_counts``)."""
    from itertools import count, filterfalse, islice

    from kvscope_probe import wire

    computed: dict[str, int] = {}
    scheduled: dict[str, int] = {}
    ids: list[str] = []
    last: list[str] = []  # the previous step's list, whatever form it came in
    pos: dict[str, int] = {}
    cols: tuple[list[int], list[int]] = ([], [])
    steps = 0
    for parts in frames:
        for r in wire.decode(parts).records:
            if type(r) is not wire.Step:
                continue
            steps += 1
            if not keep:
                continue
            new = before = r.cached_ids  # the list, written out from the form it came in
            if r.cached_same:
                new = before = last
            elif r.cached_removed is not None:  # the list before, edited (version 4)
                before = last
                new = wire.apply_cached_edit(before, r.cached_removed, new)
            last = new
            counts = r.scheduled_counts
            if not counts:  # the dict form: every count stored
                computed.update(zip(ids, cols[0], strict=True))
                scheduled.update(zip(ids, cols[1], strict=False))
                ids, pos, cols = [], {}, ([], [])
                computed.update(zip(new, r.cached_computed, strict=True))
                scheduled.update(r.num_scheduled)
            elif new is not ids and r.cached_removed is not None and ids is before:
                first = r.cached_removed[0] if r.cached_removed else len(ids)  # moved from
                for i in r.cached_removed:  # fold the requests it takes out
                    rid = ids[i]
                    computed[rid], scheduled[rid] = cols[0][i], cols[1][i]
                    del pos[rid]
                pos.update(zip(islice(new, first, None), count(first)))
                ids = new
            elif new is not ids:  # a new list: fold the requests it leaves out
                new_pos = dict(zip(new, range(len(new)), strict=True))
                for rid in filterfalse(new_pos.__contains__, ids):
                    computed[rid] = cols[0][pos[rid]]
                    scheduled[rid] = cols[1][pos[rid]]
                ids, pos = new, new_pos
            if counts:
                cols = (r.cached_computed, counts)
            for q, n in zip(r.new_reqs, counts[len(ids):] if counts else [], strict=False):
                computed[q.req_id], scheduled[q.req_id] = q.computed_tokens, n
    return {"steps": steps, "rows": 0, "synced": True, "mismatches": 0, "rejected": 0}


def recording(frames: Path | None, out: Path, args: argparse.Namespace) -> Path:
    """``frames``, or a new recording in ``out`` of the engine ``args`` describe (``pool``,
    ``preempt``, ``running``, ``warm``, ``steps``, ``interval``)."""
    if frames is not None:
        return frames
    path = out / "frames.msgpack"
    print(f"recording {record(args, path)} frames to {path}", file=sys.stderr)
    return path


def add_recording_args(p: argparse.ArgumentParser) -> None:
    """``--frames`` (a recording to replay), else ``--running`` and ``--steps`` (one to make:
    ``decoding_recording``)."""
    p.add_argument("--frames", type=Path, default=None, help="replay this recording")
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--steps", type=int, default=6000, help="steps to record")


def decoding_recording(args: argparse.Namespace, out: Path) -> Path:
    """``args.frames``, or a new recording in ``out`` of a decoding engine at ``args.running``
    seats for ``args.steps`` steps (a pool that never preempts, stepping as fast as it can)."""
    return recording(args.frames, out, argparse.Namespace(
        pool=0, preempt=False, running=args.running, warm=50, steps=args.steps, interval=0.0))


def prefixes(path: Path, short_steps: int, long_steps: int) -> tuple[int, int]:
    """The fewest leading frames holding ``short_steps`` steps, and ``long_steps``."""
    from kvscope_probe import wire

    frames = msgspec.msgpack.decode(path.read_bytes(), type=list[list[bytes]])
    seen, cuts = 0, []
    for i, parts in enumerate(frames, 1):
        seen += sum(type(r) is wire.Step for r in wire.decode(parts).records)
        cuts.append((seen, i))
    short = next((i for n, i in cuts if n >= short_steps), None)
    long = next((i for n, i in cuts if n >= long_steps), len(frames))
    if short is None or long <= short:
        raise SystemExit(f"{seen} steps in {len(frames)} frames: too few for "
                         f"--short-steps {short_steps} and --long-steps {long_steps}")
    return short, long


def child_env(exporter: Path) -> dict[str, str]:
    """A replay child's environment: quiet threads, a fixed hash seed, that exporter."""
    from instructions import QUIET_ENV

    return {**os.environ, **QUIET_ENV, "PYTHONHASHSEED": "0", "PYTHONPATH": str(exporter)}


def count(mode: str, path: Path, n: int, exporter: Path, work: Path) -> dict[str, Any]:
    """One replay child under cachegrind: its result and the instructions it executed."""
    from instructions import VALGRIND, total_ir

    out = work / f"cg.{exporter.parent.name}.{mode}.{n}"
    proc = subprocess.run(
        [*VALGRIND, f"--cachegrind-out-file={out}", sys.executable, str(Path(__file__)),
         "--replay", mode, str(path), str(n)],
        env=child_env(exporter), capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "ir": total_ir(out)}


def native(mode: str, path: Path, n: int, exporter: Path, repeats: int) -> float:
    """The least CPU seconds of ``repeats`` replays of ``n`` frames in one process
    (natively, caches hot after the first)."""
    proc = subprocess.run([sys.executable, str(Path(__file__)), "--native", mode, str(path),
                           str(n), str(repeats)], env=child_env(exporter),
                          capture_output=True, text=True, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def native_child(mode: str, path: Path, n: int, repeats: int) -> float:
    spent = []
    for _ in range(repeats):
        t = time.process_time()
        replay(mode, path, n)
        spent.append(time.process_time() - t)
    return min(spent)


def measure(path: Path, cut: tuple[int, int], exporter: Path,
            work: Path, repeats: int = 0) -> list[dict[str, Any]]:
    rows = []
    for mode in MODES:
        short = count(mode, path, cut[0], exporter, work)
        long = count(mode, path, cut[1], exporter, work)
        steps = long["steps"] - short["steps"]
        cpu = ((native(mode, path, cut[1], exporter, repeats)
                - native(mode, path, cut[0], exporter, repeats)) / steps if repeats else None)
        rows.append({"code": str(exporter.parent), "mode": mode, "steps": steps,
                     "native_us_per_step": cpu * 1e6 if cpu is not None else None,
                     "instr_per_step": (long["ir"] - short["ir"]) / steps,
                     "rows_per_step": (long["rows"] - short["rows"]) / steps,
                     "synced": long["synced"], "mismatches": long["mismatches"],
                     "rejected": long["rejected"]})
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    print(f"{'code':<28} {'mode':<6} {'steps':>6} {'instr/step':>12} {'native us':>9} "
          f"{'rows/step':>9} {'share':>6}  ledger")
    for r in rows:
        full = next(x for x in rows if x["code"] == r["code"] and x["mode"] == "full")
        ledger = ("synced" if r["synced"] else "NOT synced") + f", {r['mismatches']} mismatches"
        cpu = r["native_us_per_step"]
        print(f"{r['code'][-28:]:<28} {r['mode']:<6} {r['steps']:>6} "
              f"{r['instr_per_step'] / 1e3:>10.1f} k "
              f"{'' if cpu is None else f'{cpu:.1f}':>9} {r['rows_per_step']:>9.2f} "
              f"{r['instr_per_step'] / full['instr_per_step']:>6.2f}  {ledger}")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--replay":  # the child: imports kept to its own
        print(json.dumps(replay(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))))
        return
    if len(sys.argv) == 6 and sys.argv[1] == "--native":
        print(native_child(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
        return
    from _common import git_state

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--preempt", action="store_true",
                   help="a pool of running x 24 blocks, which preempts")
    p.add_argument("--pool", type=int, default=0,
                   help="blocks (default 32,768, or running x 24 with --preempt)")
    p.add_argument("--interval", type=float, default=0.0, help="seconds between steps")
    p.add_argument("--warm", type=int, default=50)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--short-steps", type=int, default=150,
                   help="the short replay: the first frames holding this many steps")
    p.add_argument("--long-steps", type=int, default=850, help="the long replay's")
    p.add_argument("--frames", type=Path, default=None, help="replay this recording")
    p.add_argument("--against", type=Path, nargs="*", default=[])
    p.add_argument("--native", type=int, default=5, metavar="N",
                   help="also each replay natively, the least CPU time of N (0: not)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-ingest-instr-"))
    out.mkdir(parents=True, exist_ok=True)
    path = recording(args.frames, out, args)
    cut = prefixes(path, args.short_steps, args.long_steps)
    rows = []
    for checkout in (ROOT, *args.against):
        rows += measure(path, cut, checkout.resolve() / "exporter", out, args.native)
    report(rows)
    summary = {"bench": "ingest_instructions", "running": args.running,
               "preempt": args.preempt, "pool": args.pool,
               "interval": args.interval, "frames": str(path),
               "short_frames": cut[0], "long_frames": cut[1], "git": git_state(), "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
