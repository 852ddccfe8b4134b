"""Instructions, not time: the probe's and the sidecar's cost counted by cachegrind.

    python benchmarks/instructions.py [--running 256 128 32] [--warm 40] [--short 20]
        [--long 120] [--no-sidecar | --no-probe] [--against CHECKOUT] [--out DIR]

``valgrind --tool=cachegrind --cache-sim=no`` counts every instruction of every thread
exactly, so this machine's run-to-run noise does not apply. One engine process
(``decode_feed.py --jobs``) runs under valgrind: it imports vLLM once and forks one child
per job, so the import and the twin's setup are the same in every child. Per engine
setting (``running`` seats, a 32,768-block pool that never preempts or a pool of
``running * 24`` blocks that does) four children: probe off and on (loaded the way vLLM
loads plugins, sending to a process that discards the frames), each ``warm + short`` and
``warm + long`` steps. Instructions per step = (long child - short child) / (long - short):
setup, warm-up and exit cancel. ``on / off`` is the whole engine process's ratio.

The sidecar: two ``kvscope serve --clickhouse-dsn off --decision-log off`` processes under
valgrind (two more of another checkout with ``--against``), started and stopped together
(so their idle threads run as long), one fed a short run of the largest engine setting,
the other a long one (engine children under valgrind
too, so the two sides keep their live speed ratio); their difference over the steps is
the sidecar's instructions per ingested engine step.

Under valgrind the engine steps ~50x slower, so the probe's per-interval work (the sender
wakes every ``KVSCOPE_PROBE_FLUSH_S``, keyframes every ``KVSCOPE_PROBE_KEYFRAME_S``) would
fall on fewer steps than live: the children run with the flush interval at its 1 s
maximum and keyframes every 250 s, closer to the live rate per step. A report, never an
assertion: prints a table and one JSON line (also ``summary.json``).
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
from pathlib import Path
from typing import Any

from _common import Sidecar, Sink, git_state, machine_noise, sidecar_engine
from decode_feed import NO_PREEMPT_POOL, preempting_pool

HERE = Path(__file__).resolve().parent
VALGRIND = ["valgrind", "--tool=cachegrind", "--cache-sim=no"]
QUIET_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
             "VLLM_LOGGING_LEVEL": "ERROR", "KVSCOPE_PROBE_FLUSH_S": "1.0",
             "KVSCOPE_PROBE_KEYFRAME_S": "250"}
"""BLAS threads spin under valgrind (and count); one thread each."""


def total_ir(path: Path) -> int:
    """The ``summary:`` line of a cachegrind output file: instructions executed."""
    for line in path.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise ValueError(f"no summary in {path}")


def jobs(args: argparse.Namespace, sink: str, sidecars: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for running in args.running:
        for pre in (False, True) if not args.no_probe else ():
            pool = preempting_pool(running) if pre else NO_PREEMPT_POOL
            for probe in ("", sink):
                for n in (args.short, args.long):
                    out.append({"running": running, "pool": pool, "warm": args.warm,
                                "steps": n, "probe": probe, "preempt": pre,
                                "tag": f"p{running}-{pool}-{n}"})
        if running == max(args.running) and sidecars:  # after the 256 settings, the sidecar's pair
            for key, endpoint in sidecars.items():
                n = args.short if key.endswith("short") else args.long
                out.append({"running": running, "pool": NO_PREEMPT_POOL, "warm": args.warm,
                            "steps": n, "probe": endpoint, "preempt": False,
                            "tag": f"side-{key}", "sidecar": key})
    return out


def start_sidecars(work: Path, against: Path | None) -> dict[str, Sidecar]:
    """The sidecars, keyed ``"<label>-<short|long>"``, started one after the other (each
    waits to answer). Label ``this``: this checkout; ``against``: another checkout whose
    ``exporter/`` they import instead (a baseline), measured in the same run."""
    srcs: dict[str, Path | None] = {"this": None}
    if against is not None:
        srcs["against"] = against
    sides = {}
    for label, src in srcs.items():
        for length in ("short", "long"):
            key = f"{label}-{length}"
            d = work / f"side-{key}"
            (d / "run").mkdir(parents=True)
            sides[key] = s = Sidecar(
                f"ipc://{d}/run/probe.sock", d / "sidecar.log",
                ["--clickhouse-dsn=off", "--decision-log=off", f"--data-dir={d}/data"],
                prefix=[*VALGRIND, f"--cachegrind-out-file={d}/cg.out"])
            path = os.environ.pop("PYTHONPATH", None)
            if src is not None:
                os.environ["PYTHONPATH"] = f"{src}/exporter"
            try:
                s.start(900.0)
            finally:
                os.environ.pop("PYTHONPATH", None)
                if path is not None:
                    os.environ["PYTHONPATH"] = path
    return sides


def per_step(rows: list[dict[str, Any]], key: Any) -> dict[str, Any] | None:
    pair = sorted((r for r in rows if key(r)), key=lambda r: r["job"]["steps"])
    if len(pair) != 2:
        return None
    a, b = pair
    steps = b["steps"] - a["steps"]
    return {"ir_per_step": (b["ir"] - a["ir"]) / steps, "steps": steps,
            "running_mean": b["running_mean"], "preemptions": b["preemptions"] - a["preemptions"]}


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    table = []
    print(f"{'running':>7} {'pool':>6} {'preempts':>8} {'off Ir/step':>12} "
          f"{'on Ir/step':>12} {'+Ir/step':>10} {'on/off':>7}")
    for running in args.running:
        for pre in (False, True):
            sel = [r for r in rows if r["job"]["running"] == running
                   and r["job"]["preempt"] == pre and "sidecar" not in r["job"]]
            off = per_step(sel, lambda r: not r["job"]["probe"])
            on = per_step(sel, lambda r: bool(r["job"]["probe"]))
            if off is None or on is None:
                continue
            row = {"running": running, "pool": sel[0]["job"]["pool"], "off": off, "on": on,
                   "ratio": on["ir_per_step"] / off["ir_per_step"]}
            table.append(row)
            print(f"{running:7d} {row['pool']:6d} {on['preemptions']:8d} "
                  f"{off['ir_per_step'] / 1e6:11.2f}M {on['ir_per_step'] / 1e6:11.2f}M "
                  f"{(on['ir_per_step'] - off['ir_per_step']) / 1e3:9.0f}k "
                  f"{row['ratio']:7.4f}", flush=True)
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
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvscope-instr-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(QUIET_ENV)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # so `finally` stops what it started
    sink = Sink(f"ipc://{work}/sink.sock")
    sink.start()
    sides = {} if args.no_sidecar else start_sidecars(work, args.against)
    rows: list[dict[str, Any]] = []
    proc: subprocess.Popen[str] | None = None
    try:
        todo = jobs(args, sink.endpoint, {k: s.endpoint for k, s in sides.items()})
        argv = [*VALGRIND, f"--cachegrind-out-file={work}/cg.%p", sys.executable,
                str(HERE / "decode_feed.py"), "--jobs", json.dumps(todo)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, start_new_session=True)
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            r["ir"] = total_ir(work / f"cg.{r['pid']}")
            rows.append(r)
            print(f"  job {r['job']['tag']} probe={'on' if r['job']['probe'] else 'off'}: "
                  f"{r['steps']} steps, {r['ir'] / 1e9:.2f} G instructions", flush=True)
        proc.wait()
        proc = None
        side = sidecar_instructions(sides, rows) if sides else None
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
        sink.stop()
        for s in sides.values():
            s.stop(120.0)
    table = report(rows, args)
    summary = {"git": git_state(), "noise": machine_noise(), "probe": table,
               "sidecar": side, "jobs": rows, "args": vars(args) | {"out": str(out)}}
    for label, r in (side or {}).items():
        print(f"sidecar ({label}): {r['ir_per_step'] / 1e6:.3f} M instructions per ingested "
              f"engine step ({r['steps']} steps apart)")
    line = json.dumps(summary, default=str)
    (out / "summary.json").write_text(line)
    print(line)


def sidecar_instructions(sides: dict[str, Sidecar], rows: list[dict[str, Any]]) -> Any:
    """Wait until each sidecar has every step of its feed, stop them all together, and
    difference each label's long and short sidecar."""
    fed = {r["job"]["sidecar"]: r for r in rows if "sidecar" in r["job"]}
    if set(fed) != set(sides):
        return None
    for key, s in sides.items():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            seen = sidecar_engine(s.url, fed[key]["job"]["tag"]) or {}
            if seen.get("steps", 0) >= fed[key]["steps"]:
                break
            time.sleep(1)
    for s in sides.values():
        os.killpg(s.pid, signal.SIGTERM)
    for s in sides.values():
        s.proc.wait(300)  # type: ignore[union-attr]
    ir = {k: total_ir(Path(s.endpoint.removeprefix("ipc://")).parent.parent / "cg.out")
          for k, s in sides.items()}
    out = {}
    for label in sorted({k.rsplit("-", 1)[0] for k in sides}):
        steps = fed[f"{label}-long"]["steps"] - fed[f"{label}-short"]["steps"]
        out[label] = {"ir_per_step": (ir[f"{label}-long"] - ir[f"{label}-short"]) / steps,
                      "steps": steps, "ir": {k: v for k, v in ir.items()
                                             if k.startswith(label)}}
    return out


if __name__ == "__main__":
    main()
