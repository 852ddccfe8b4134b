"""Instructions, not time: the probe's and the sidecar's cost counted by cachegrind.

    python benchmarks/instructions.py [--running 256 128 32] [--warm 40] [--short 20]
        [--long 120] [--no-sidecar | --no-probe [--pace N]] [--against CHECKOUT]
        [--floor] [--without-need] [--threads] [--layout-interval S]
        [--store [--store-intervals BATCH INSERT]] [--out DIR]

``valgrind --tool=cachegrind --cache-sim=no`` counts every instruction of every thread
exactly, so this machine's run-to-run noise does not apply. One engine process
(``decode_feed.py --jobs``) runs under valgrind: it imports vLLM once and forks one child
per job, so the import and the twin's setup are the same in every child. Per engine
setting (``running`` seats, a 32,768-block pool that never preempts or a pool of
``running * 24`` blocks that does) four children: probe off and on (loaded the way vLLM
loads plugins, sending to a process that discards the frames), each ``warm + short`` and
``warm + long`` steps. Instructions per step = (long child - short child) / (long - short):
setup, warm-up and exit cancel. ``on / off`` is the whole engine process's ratio.

The sidecar: two ``kvscope serve --clickhouse-dsn off --decision-log off`` processes (with
``--store``: the embedded chDB store in the data dir and the decision log to a file, as
deployed) under valgrind (two more of another checkout with ``--against``), started and
stopped together (so their idle threads run as long), one fed a short run of the largest
engine setting, the other a long one; their difference over the steps is the sidecar's
instructions per ingested engine step. The engine runs under valgrind too, so the two
sides keep their live speed ratio; or, with ``--pace N`` (``--no-probe`` only), natively
at N steps a second, the rate a valgrind sidecar keeps up with, which skips vLLM's import
under valgrind (tens of minutes on a loaded 2-core machine). Per-second work is then
~N/100 of a live engine's steps apart: ``--layout-interval`` scales the layout sampler to
match (at 5 steps/s, 20 s is one snapshot per 100 steps, as live at 100 steps/s), and
``--store-intervals`` the store's batches and inserts; the ledger's longest-free-run
sample (at most every 0.1 s of wall time) is not rescaled. With the store, both sidecars
seal and insert what they hold when they stop, so a batch's and an insert's fixed costs
cancel where the intervals are longer than the run (live they fall every ~1,350 and ~8,100
steps at 270 steps a second) and every table has rows in both feeds: let the short feed
end after requests have finished (``--warm 400`` at 256 running), or the long sidecar
inserts tables the short one never did and their fixed cost reads as its rows'. chDB's
background merges after the last insert are not in the count.

Under valgrind the engine steps ~50x slower, so the probe's per-interval work (the sender
wakes every ``KVSCOPE_PROBE_FLUSH_S``, keyframes every ``KVSCOPE_PROBE_KEYFRAME_S``) would
fall on fewer steps than live: the children run with the flush interval at its 1 s
maximum and keyframes every 250 s, closer to the live rate per step. A report, never an
assertion: prints a table and one JSON line (also ``summary.json``).

Python's cyclic collector is paused in the probe's children from their first measured step
until they exit (off and on alike; ``--collector`` leaves it running). Collections are rare
in this engine (at most ~20 generation-0 and one full collection in 3,000 steps:
``probe_gc.py``), but a full one of vLLM's heap costs ~250 M instructions (244 ms natively
at 256 running), and it lands in a 100-step window by chance: the preempting pair at 256
running read x1.095-x1.10 with one in its "on" window: where a collection fell, not what
the probe costs. Paused, and not enabled again (which ran the deferred collection inside
the same child), the windows count the probe's own work; whether the probe makes
collections more frequent is measured apart, natively over thousands of steps
(``probe_gc.py``: collections follow allocations, not time). The table's last column
counts full collections in each window.

``--floor`` adds two children per setting with the floor's hooks instead of the probe
(``micro_floor.install_floor``: a layer per pool call keeping its blocks and, after
``schedule()``, what the sidecar's ledger reads, encoded at once, with each touched
block's ID, reference count and hash; no op order, preemption facts, blocks-needed hook,
audit, heartbeat or sender): ``floor / off`` is what the least exact recording costs the
same engine, the line under which no probe keeping the ledger exact can go.

``--threads`` counts with callgrind instead (the same instructions, about three times
slower), one file per thread: the table adds, per setting, what the probe (and the floor)
add on the engine thread and on the other threads (the sender, libzmq's I/O thread); each
sidecar's figure is split by thread class (``SIDECAR_THREADS``): which thread runs the
instructions, to set beside what each thread's CPU time is live (``sidecar_live.py``).

The parent runs a tiny engine before it forks: building a scheduler imports ~250 more
modules, and the first child used to compile those without a .pyc, which the next
children loaded from disk (~100 M instructions in one child alone: x1.18 at 256 running).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import Sidecar, Sink, git_state, machine_noise, sidecar_engine
from decode_feed import NO_PREEMPT_POOL, preempting_pool

HERE = Path(__file__).resolve().parent
VALGRIND = ["valgrind", "--tool=cachegrind", "--cache-sim=no"]
BY_THREAD = ["valgrind", "--tool=callgrind", "--separate-threads=yes"]
"""``--threads``: callgrind counts the same instructions, one output file per thread."""
QUIET_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "VLLM_LOGGING_LEVEL": "ERROR", "KVSCOPE_PROBE_FLUSH_S": "1.0",
             "KVSCOPE_PROBE_KEYFRAME_S": "250", "PYTHONHASHSEED": "0"}
"""BLAS threads spin under valgrind (and count); one thread each. String hashes are seeded
per process: a fixed seed makes every run's sets and dicts of request IDs the same."""


def total_ir(path: Path, wait_s: float = 120.0) -> int:
    """The ``summary:`` line of a cachegrind output file: instructions executed. A forked
    child prints its result before it exits, and valgrind writes the file at its exit:
    wait for the summary (up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        text = path.read_text() if path.exists() else ""
        for line in text.splitlines():
            if line.startswith("summary:"):
                return int(line.split()[1])
        if time.monotonic() > deadline:
            raise ValueError(f"no summary in {path} after {wait_s:.0f} s")
        time.sleep(0.5)


def thread_ir(work: Path, pid: int) -> dict[str, int]:
    """``--threads``: a child's instructions by thread, from callgrind's files
    ``cg.<pid>-<NN>``: ``engine`` (thread 1, vLLM's engine thread, where the probe's hooks
    run) and ``others`` (the probe's sender, libzmq's threads). Read after the child
    exited (callgrind writes the files then)."""
    ir = {int(f.name.rsplit("-", 1)[1]): total_ir(f) for f in work.glob(f"cg.{pid}-*")}
    return {"engine": ir.pop(1), "others": sum(ir.values())}


SIDECAR_THREADS = (("main and store sending", ("Py_RunMain", "pybind11")),
                   ("ingest", ("mpack_decode",)),
                   ("decision log", ("json_encode",)),
                   ("store batching", ("arrow::ipc",)),
                   ("layout and other Python", ("PyEval",)))
"""``--threads``: a sidecar thread's class, by the first of these whose C functions it ran
(callgrind names no Python function and no thread): the main thread runs Py_RunMain, and
chDB's connection opens on it or on the store's sending thread (chDB's queries go through
pybind11, a reader's on an HTTP worker too), whichever gets there first, so the two are
one class; msgspec's decoder runs on the ingest thread, its JSON encoder on the decision
log's, pyarrow's IPC writer on the store's batching thread; the rest of the threads that
run Python are the layout sampler's (most of it), the socket thread's and the HTTP
server's workers. Threads that run no Python are chDB's and libzmq's own (``native``)."""


def sidecar_thread_ir(out: Path) -> dict[str, int]:
    """``--threads``: a sidecar's instructions by thread class (``SIDECAR_THREADS``), from
    callgrind's files ``<out>-<NN>``."""
    by: dict[str, int] = {}
    for f in sorted(out.parent.glob(f"{out.name}-*")):
        text = f.read_text(errors="replace")
        kind = next((k for k, marks in SIDECAR_THREADS if any(m in text for m in marks)),
                    "native")
        by[kind] = by.get(kind, 0) + total_ir(f)
    return by


def jobs(args: argparse.Namespace, sink: str, sidecars: dict[str, str]) -> list[dict[str, Any]]:
    """The sidecars' feeds first (the largest setting), then the probe's settings."""
    out = []
    for key, endpoint in sidecars.items():
        n = args.short if key.endswith("short") else args.long
        out.append({"running": max(args.running), "pool": NO_PREEMPT_POOL, "warm": args.warm,
                    "steps": n, "probe": endpoint, "preempt": False, "tag": f"side-{key}",
                    "sidecar": key, "interval": 1 / args.pace if args.pace else 0.0})
    for running in args.running if not args.no_probe else ():
        for pre in (False, True):
            pool = preempting_pool(running) if pre else NO_PREEMPT_POOL
            variants = ([("off", ""), ("on", sink)] + ([("floor", "")] if args.floor else [])
                        + ([("no-need", sink)] if args.without_need else []))
            for variant, probe in variants:
                for n in (args.short, args.long):
                    out.append({"running": running, "pool": pool, "warm": args.warm,
                                "steps": n, "probe": probe, "preempt": pre,
                                "tag": f"p{running}-{pool}-{n}", "variant": variant,
                                "floor": variant == "floor", "need": variant != "no-need",
                                "collector": args.collector})
    return out


def store_flags(args: argparse.Namespace, d: Path) -> list[str]:
    """The sidecars' store and decision log: off, or (``--store``) on as deployed, the
    embedded chDB in the data dir and the decision log to a file, batches and inserts
    ``--store-intervals`` seconds apart."""
    if not args.store:
        return ["--clickhouse-dsn=off", "--decision-log=off"]
    batch, insert = args.store_intervals
    return [f"--decision-log={d}/decisions.log", f"--clickhouse-batch-interval={batch}",
            f"--clickhouse-insert-interval={insert}"]


def make_sidecars(work: Path, args: argparse.Namespace) -> dict[str, Sidecar]:
    """The sidecars, keyed ``"<label>-<short|long>"``: label ``this`` runs this checkout,
    ``against`` another checkout's ``exporter/`` (a baseline, measured in the same run)."""
    against, sides = args.against, {}
    for label in ("this", "against") if against is not None else ("this",):
        for length in ("short", "long"):
            key = f"{label}-{length}"
            d = work / f"side-{key}"
            (d / "run").mkdir(parents=True)
            sides[key] = Sidecar(
                f"ipc://{d}/run/probe.sock", d / "sidecar.log",
                [*store_flags(args, d), f"--data-dir={d}/data",
                 f"--layout-interval={args.layout_interval}"],
                prefix=([*BY_THREAD, f"--callgrind-out-file={d}/cg.out"] if args.threads
                        else [*VALGRIND, f"--cachegrind-out-file={d}/cg.out"]),
                env={"PYTHONPATH": f"{against}/exporter"} if label == "against" else None)
    return sides


def start_sidecars(sides: dict[str, Sidecar]) -> None:
    """Start them all at once and wait until each answers; the engine may already be
    sending: ZMQ queues its frames until the sidecar binds."""
    with ThreadPoolExecutor(len(sides) or 1) as pool:
        list(pool.map(lambda s: s.start(1200.0), sides.values()))


def per_step(rows: list[dict[str, Any]], key: Any) -> dict[str, Any] | None:
    pair = sorted((r for r in rows if key(r)), key=lambda r: r["job"]["steps"])
    if len(pair) != 2:
        return None
    a, b = pair
    steps = b["steps"] - a["steps"]
    full = [y - x for x, y in zip(a["collections"], b["collections"], strict=True)]
    threads = ({k: (b["ir_threads"][k] - a["ir_threads"][k]) / steps
                for k in a["ir_threads"]} if "ir_threads" in a else None)
    return {"ir_per_step": (b["ir"] - a["ir"]) / steps, "steps": steps, "by_thread": threads,
            "running_mean": b["running_mean"], "preemptions": b["preemptions"] - a["preemptions"],
            "collections": full}


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    table = []
    print(f"{'running':>7} {'pool':>6} {'preempts':>8} {'off Ir/step':>12} "
          f"{'on Ir/step':>12} {'+Ir/step':>10} {'on/off':>7} {'full GCs off/on':>16}"
          + (f" {'floor +Ir/step':>14} {'floor/off':>9}" if args.floor else ""))
    for running in args.running:
        for pre in (False, True):
            sel = [r for r in rows if r["job"]["running"] == running
                   and r["job"]["preempt"] == pre and "sidecar" not in r["job"]]
            off, on, floor, no_need = (per_step(sel, lambda r, v=v: r["job"].get("variant") == v)
                                       for v in ("off", "on", "floor", "no-need"))
            if off is None or on is None:
                continue
            base = off["ir_per_step"]
            row = {"running": running, "pool": sel[0]["job"]["pool"], "off": off, "on": on,
                   "ratio": on["ir_per_step"] / base}
            if floor is not None:
                row |= {"floor": floor, "floor_ratio": floor["ir_per_step"] / base}
            if no_need is not None:
                row |= {"no_need": no_need, "no_need_ratio": no_need["ir_per_step"] / base}
            table.append(row)
            print(f"{running:7d} {row['pool']:6d} {on['preemptions']:8d} "
                  f"{base / 1e6:11.2f}M {on['ir_per_step'] / 1e6:11.2f}M "
                  f"{(on['ir_per_step'] - base) / 1e3:9.0f}k "
                  f"{row['ratio']:7.4f} {off['collections'][2]:>8d}/{on['collections'][2]:<7d}"
                  + (f" {(floor['ir_per_step'] - base) / 1e3:13.0f}k {row['floor_ratio']:9.4f}"
                     if floor is not None else ""), flush=True)
            if no_need is not None:
                print(f"{'':15} on without the blocks-needed hook: "
                      f"+{(no_need['ir_per_step'] - base) / 1e3:.0f}k "
                      f"x{row['no_need_ratio']:.4f}", flush=True)
            for name, v in (("on", on), ("floor", floor)):
                if v is not None and v["by_thread"] and off["by_thread"]:
                    engine, others = (v["by_thread"][k] - off["by_thread"][k]
                                      for k in ("engine", "others"))
                    print(f"{'':15} {name} - off by thread: engine {engine / 1e3:.1f}k, "
                          f"others {others / 1e3:.1f}k per step", flush=True)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--running", type=int, nargs="+", default=[256, 128, 32])
    p.add_argument("--warm", type=int, default=40)
    p.add_argument("--short", type=int, default=20)
    p.add_argument("--long", type=int, default=120)
    p.add_argument("--no-sidecar", action="store_true")
    p.add_argument("--no-probe", action="store_true", help="only the sidecar's pair")
    p.add_argument("--against", type=Path, default=None,
                   help="also measure the sidecar of this checkout (a baseline)")
    p.add_argument("--pace", type=float, default=0.0,
                   help="with --no-probe: run the engine natively at this many steps a "
                        "second instead of under valgrind")
    p.add_argument("--floor", action="store_true",
                   help="also count the floor (micro_floor.install_floor: the least a probe "
                        "keeping the ledger exact does) in two more children per setting")
    p.add_argument("--without-need", action="store_true",
                   help="also count the probe with its blocks-needed hook never armed "
                        "(attribution: what that hook costs)")
    p.add_argument("--threads", action="store_true",
                   help="count with callgrind, by thread (slower): the probe's children (the "
                        "engine thread apart from the sender's and libzmq's) and the sidecars "
                        "(SIDECAR_THREADS)")
    p.add_argument("--collector", action="store_true",
                   help="leave Python's cyclic collector running in the measured steps of "
                        "the probe's children (by default it is paused there: see the doc)")
    p.add_argument("--layout-interval", type=float, default=1.0,
                   help="the sidecars' --layout-interval (seconds)")
    p.add_argument("--store", action="store_true",
                   help="the sidecars with the embedded store and the decision log on")
    p.add_argument("--store-intervals", type=float, nargs=2, default=(5.0, 30.0),
                   metavar=("BATCH", "INSERT"),
                   help="with --store: the sidecars' --clickhouse-batch-interval and "
                        "--clickhouse-insert-interval (seconds; scale them with --pace)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvscope-instr-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(QUIET_ENV)
    os.environ["PYTHONPATH"] = str(HERE.parent / "exporter")  # this checkout, not the venv's
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # so `finally` stops what it started
    sink = Sink(f"ipc://{work}/sink.sock")
    sink.start()
    sides = {} if args.no_sidecar else make_sidecars(work, args)
    rows: list[dict[str, Any]] = []
    proc: subprocess.Popen[str] | None = None
    side: dict[str, Any] | None = None
    try:
        todo = jobs(args, sink.endpoint, {k: s.endpoint for k, s in sides.items()})
        under = ([] if args.pace else
                 [*BY_THREAD, f"--callgrind-out-file={work}/cg.%p"] if args.threads else
                 [*VALGRIND, f"--cachegrind-out-file={work}/cg.%p"])
        argv = [*under, sys.executable,
                str(HERE / "decode_feed.py"), "--jobs", json.dumps(todo), "--wait"]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        start_sidecars(sides)  # while the engine imports vLLM
        proc.stdin.write("\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            # callgrind writes a child's threads' files at its exit, after this line: read
            # once every child is done (below)
            r["ir"] = 0 if args.pace or args.threads else total_ir(work / f"cg.{r['pid']}")
            rows.append(r)
            print(f"  job {r['job']['tag']} {r['job'].get('variant', 'sidecar feed')}: "
                  f"{r['steps']} steps, {r['ir'] / 1e9:.2f} G instructions", flush=True)
            if sides and side is None and len(rows) == len(sides):  # their feeds are done
                side = sidecar_instructions(sides, rows, args.threads)
                for label, v in side.items():
                    print(f"sidecar ({label}): {v['ir_per_step'] / 1e6:.3f} M instructions "
                          f"per ingested engine step", flush=True)
                    for kind, n in (v["by_thread"] or {}).items():
                        print(f"  {kind}: {n / 1e3:.1f} k", flush=True)
        proc.wait()
        proc = None
        for r in rows if args.threads and not args.pace else ():  # the feeds' too: same files
            r["ir_threads"] = thread_ir(work, r["pid"])
            r["ir"] = sum(r["ir_threads"].values())
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
        sink.stop()
        for s in sides.values():
            s.stop(120.0)
    table = report(rows, args)
    summary = {"git": git_state(), "noise": machine_noise(), "probe": table,
               "sidecar": side, "jobs": rows, "args": vars(args) | {"out": str(out)}}
    line = json.dumps(summary, default=str)
    (out / "summary.json").write_text(line)
    print(line)


SETTLED_S = 10.0
"""Seconds a sidecar's step count must stay put, its engine gone, before it is taken as all
it will get."""


def sidecar_instructions(sides: dict[str, Sidecar], rows: list[dict[str, Any]],
                         threads: bool = False) -> dict[str, Any]:
    """Wait until each sidecar has every step of its feed, stop them all together, and
    difference each label's long and short sidecar by the steps each ingested.

    A probe's last frame can be lost as its engine exits (it flushes for at most ~2 s,
    and a sidecar under valgrind may not read it in time): a sidecar whose engine is gone
    and whose count stayed the same for ``SETTLED_S`` is not waited for further, and its
    own count is the one divided by. Waiting longer cost more than the missing steps: a
    sidecar left waiting past ``--store-intervals`` seals and inserts while its pair does
    not (2.89 M a step against 0.75 M, one such run)."""
    fed = {r["job"]["sidecar"]: r for r in rows if "sidecar" in r["job"]}
    ingested: dict[str, int] = {}
    for key, s in sides.items():
        deadline = time.monotonic() + 600
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            seen = sidecar_engine(s.url, fed[key]["job"]["tag"]) or {}
            ingested[key] = n = seen.get("steps", 0)
            if n >= fed[key]["steps"]:
                break
            if n != last:
                last, since = n, time.monotonic()
            elif seen.get("state") == "gone" and time.monotonic() - since >= SETTLED_S:
                print(f"  sidecar {key}: {n} of {fed[key]['steps']} steps, "
                      f"{seen.get('ledger_gaps')} gaps, {seen.get('probe_records_dropped')} "
                      "records dropped by the probe", flush=True)
                break
            time.sleep(1)
    for s in sides.values():
        os.killpg(s.pid, signal.SIGTERM)
    for s in sides.values():
        s.proc.wait(300)  # type: ignore[union-attr]
    files = {k: Path(s.endpoint.removeprefix("ipc://")).parent.parent / "cg.out"
             for k, s in sides.items()}
    by = {k: sidecar_thread_ir(f) for k, f in files.items()} if threads else {}
    ir = ({k: sum(v.values()) for k, v in by.items()} if threads else
          {k: total_ir(f) for k, f in files.items()})
    out = {}
    for label in sorted({k.rsplit("-", 1)[0] for k in sides}):
        steps = ingested[f"{label}-long"] - ingested[f"{label}-short"]
        long, short = by.get(f"{label}-long", {}), by.get(f"{label}-short", {})
        out[label] = {"ir_per_step": (ir[f"{label}-long"] - ir[f"{label}-short"]) / steps,
                      "by_thread": {k: (long.get(k, 0) - short.get(k, 0)) / steps
                                    for k in sorted(long.keys() | short.keys())} or None,
                      "steps": steps, "fed": {k: fed[k]["steps"] for k in fed
                                              if k.startswith(label)},
                      "ingested": {k: v for k, v in ingested.items() if k.startswith(label)},
                      "ir": {k: v for k, v in ir.items() if k.startswith(label)}}
    return out


if __name__ == "__main__":
    main()
