"""The sidecar's cost live: a real ``kvscope serve`` fed by real probes in twin engines.

    python benchmarks/sidecar_live.py [--variants on off on-1s on-loki] [--engines 1]
        [--running 256] [--pool 32768] [--interval 0] [--steps 2000] [--skip-s 0]
        [--rss-every-s 15] [--py-spy] [--against CHECKOUT] [--rounds 1] [--out DIR]

Each engine is ``decode_feed.py`` in its own process: vLLM's real scheduler with no model,
16-token blocks, a ``--pool`` of 32,768 blocks by default, ``--running`` seats kept busy
by short-prompt, long-output requests, at most one step each ``--interval`` seconds, and
the probe loaded the way vLLM loads plugins. ``on``: the sidecar as deployed by default
(the embedded chDB store in its data dir and the decision log to a file); ``off``:
``--clickhouse-dsn off --decision-log off``; ``on-1s``: ``on`` with the store's batches
gathered for 1 s (the default before it was 5 s); ``on-loki``: ``on`` pushing the decisions
to Loki's HTTP API too (``--loki-url``: an endpoint in this script's process that takes
each push as Loki does, counts its lines and answers 204; no Loki server runs here).

What is measured, per variant: the whole ``kvscope serve`` process's CPU (every thread:
ingest, HTTP, layout sampler, store) from the moment the engines start stepping until
the sidecar has ingested their last step, minus its idle CPU rate (measured for
``--idle-s`` before the engines connect, from every thread's scheduler nanoseconds: the
process's clock-tick total, 10 ms a tick, read 4 to 8 ms a second for the same idle
sidecar over 5 s) over the same time, divided by the engine steps it ingested (with
``--skip-s``, the window starts that long after the engines start stepping: what each
engine's connection costs once, its first layout row in the store above all, is left out);
the rows it wrote per second and per step per engine (``kvscope_sink_rows_written_total``;
a store-on window in which the store's rows did not grow held none of its inserts, which
go in every 30 s a table, and the script says so under the table: on a machine that steps
~400 times a second, 10,000 steps is a 20 s window, and 30,000 or more holds two or three);
its own report of its CPU by thread (``kvscope_sidecar_cpu_seconds_total``), per step; its
RSS growth per engine at the window's end, and its RSS every ``--rss-every-s`` seconds of
the window (the layout history fills for minutes, so a short window's growth is a point
on a climb); and with ``--py-spy`` a ``py-spy record -r 200 -f raw --threads``
profile of the sidecar over the feed, summed by thread and by function. A report, never
an assertion: prints a table and one JSON line (also ``summary.json``). ``--against``
runs each variant with another checkout's sidecar too (its ``exporter/`` first on the
sidecar's ``PYTHONPATH``; the engines and the probe stay this checkout's), right after
this one's: compare sidecars in one run, not across runs. ``--rounds N`` runs the whole
sequence N times over and ends with each sidecar and variant's median and range: the same
code read 88, 100 and 118 µs a step in three runs within half an hour on this machine, so
one run says little about a target within that spread.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from _common import Sidecar, git_state, machine_noise, scrape, sidecar_engine, write_summary
from decode_feed import NO_PREEMPT_POOL

from kvscope.decisions.loki import PUSH_PATH
from kvscope.localvllm.server import HOST
from kvscope.procs import stop_process

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "on": lambda work: [f"--data-dir={work}/data", f"--decision-log={work}/decisions.log"],
    "off": lambda work: ["--clickhouse-dsn=off", "--decision-log=off",
                         f"--data-dir={work}/data"],
    "on-1s": lambda work: [f"--data-dir={work}/data", f"--decision-log={work}/decisions.log",
                           "--clickhouse-batch-interval=1"],
    "on-loki": lambda work: [f"--data-dir={work}/data", f"--decision-log={work}/decisions.log",
                             f"--loki-url={loki_push().url}"],
}
WATCH = ("EngineState._step", "RequestTracker._step", "RequestTracker._event",
         "Ledger.apply_tables", "Ledger.apply", "decode", "LayoutSampler", "snapshot",
         "SinkManager.emit", "ClickHouseSink", "DecisionLog")


def rss_kib(pid: int) -> dict[str, int]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: int(status[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def sample_rss(pid: int, every_s: float, stop: threading.Event,
               into: list[tuple[float, float]]) -> threading.Thread:
    """A thread appending (seconds since it started, RSS MiB) of ``pid`` to ``into`` every
    ``every_s`` seconds until ``stop`` is set (and once more then)."""
    def run() -> None:
        t0 = time.monotonic()
        while True:
            stopping = stop.wait(every_s)
            at = round(time.monotonic() - t0, 1)
            if into and at - into[-1][0] < 1.0:  # stopped right after a sample
                return
            try:
                into.append((at, round(rss_kib(pid)["VmRSS"] / 1024, 1)))
            except OSError:  # the process ended
                return
            if stopping:
                return

    thread = threading.Thread(target=run, name="rss-sampler", daemon=True)
    thread.start()
    return thread


def counters(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """From one scrape: rows written (``sink:table``) and the sidecar's own CPU seconds
    by thread as it reports them (``kvscope_sidecar_cpu_seconds_total``; empty from a
    checkout without it)."""
    rows: dict[str, float] = {}
    own: dict[str, float] = {}
    text = __import__("httpx").get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvscope_sink_rows_written_total":
                key = s.labels.get("table") or s.labels.get("kind") or "all"
                key = f"{s.labels.get('sink', '')}:{key}"
                rows[key] = rows.get(key, 0.0) + s.value
            elif s.name == "kvscope_sidecar_cpu_seconds_total":
                own[s.labels["thread"]] = s.value
    return rows, own


def start_engines(args: argparse.Namespace, endpoint: str, tag: str) -> list[Any]:
    procs = []
    for i in range(args.engines):
        argv = [sys.executable, str(HERE / "decode_feed.py"), "--running", str(args.running),
                "--warm", str(args.warm), "--steps", str(args.steps), "--probe", endpoint,
                "--engine", f"{tag}-e{i}", "--wait", "--pool", str(args.pool),
                "--interval", str(args.interval)]
        procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True,
                                      start_new_session=True))
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"engine did not start: {line!r}")
    return procs


def profile(pid: int, path: Path) -> subprocess.Popen[bytes]:
    argv = [str(Path(sys.executable).parent / "py-spy"), "record", "-r", "200", "-f", "raw",
            "--threads", "--nonblocking", "-p", str(pid), "-o", str(path)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


THREADS = (("_ingest_loop", "ingest"), ("LayoutSampler._run", "layout sampler"),
           ("_batch_loop", "store batch"), ("_send_loop", "store send"),
           ("DecisionLog._run", "decision log"), ("Server.run", "http"))


Thread = tuple[str, float, float, int]
"""A thread's OS name, CPU seconds so far, of which in the kernel, and minor page faults."""


def os_threads(pid: int) -> dict[int, Thread]:
    """Each thread of ``pid`` (``Thread``). Python's threads share the process's name;
    the embedded chDB's native threads have names of their own, so this shows what py-spy
    (Python stacks only) cannot: ClickHouse's own work."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, Thread] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (comm, (int(fields[11]) + int(fields[12])) / tick,
                               int(fields[12]) / tick, int(fields[7]))
    return out


def threads_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s live threads, from the scheduler's nanoseconds (a thread
    that ends between two readings is missed: read over an idle sidecar)."""
    from sidecar_feed import schedstat

    return sum(cpu for _, cpu in schedstat(pid).values())


def by_thread_name(before: dict[int, tuple[Any, ...]], after: dict[int, tuple[Any, ...]],
                   pid: int, field: int = 1) -> dict[str, float]:
    """A ``Thread`` field's growth between two ``os_threads`` readings (CPU seconds by
    default; or any readings of (name, figure, ...) by thread ID), by thread name (the
    process's own name, for its Python threads, as "python"); threads that ended meanwhile
    are missed."""
    main = after.get(pid, before.get(pid, ("", 0.0, 0.0, 0)))[0]
    by: Counter[str] = Counter()
    for tid, now in after.items():
        name = "python" if now[0] == main else now[0].rstrip("0123456789")
        by[name] += now[field] - before.get(tid, (now[0], 0.0, 0.0, 0))[field]
    return {k: round(v, 3) for k, v in by.most_common() if v > 0}


def thread_of(names: set[str]) -> str:
    """Which sidecar thread a stack is from, by its thread's entry function (py-spy
    names threads by ID only)."""
    for fn, thread in THREADS:
        if any(n.endswith(fn) for n in names):
            return thread
    return "other"


def breakdown(path: Path) -> dict[str, Any]:
    """Samples by thread and (inclusive) by watched function, as shares of all samples."""
    threads: Counter[str] = Counter()
    funcs: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        total += count
        names = {f.split(" (")[0] for f in frames[1:]}
        threads[thread_of(names)] += count
        for w in WATCH:
            if any(w in name for name in names):
                funcs[w] += count
        if len(frames) > 1:
            leaf[frames[-1].split(" (")[0]] += count
    share = lambda c: {k: round(v / total, 3) for k, v in c.most_common(12)}  # noqa: E731
    return {"samples": total, "threads": share(threads), "inclusive": share(funcs),
            "self": share(leaf)}


def start_sidecar(endpoint: str, vdir: Path, variant: str, src: Path | None) -> Sidecar:
    """``kvscope serve`` of this checkout, or of ``src``'s ``exporter/`` (a baseline)."""
    side = Sidecar(endpoint, vdir / "sidecar.log", VARIANTS[variant](vdir))
    if src is not None:
        os.environ["PYTHONPATH"] = f"{src}/exporter"
    try:
        side.start(60.0)
    finally:
        os.environ.pop("PYTHONPATH", None)
    return side


class LokiPush(ThreadingHTTPServer):
    """Loki's push endpoint as a sidecar meets it, on 127.0.0.1 in the benchmark's process
    (its CPU is not the sidecar's): each ``POST /loki/api/v1/push`` read whole, its lines
    counted, answered 204 as Loki answers; anything else 404."""

    def __init__(self) -> None:
        super().__init__((HOST, 0), _PushHandler)
        self.lines = 0
        self.pushes = 0
        self.url = f"http://{HOST}:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, name="loki-push", daemon=True).start()


class _PushHandler(BaseHTTPRequestHandler):
    server: LokiPush

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != PUSH_PATH:
            self.send_response(404)
        else:
            try:
                lines = sum(len(st["values"]) for st in json.loads(body)["streams"])
            except (ValueError, KeyError, TypeError):  # not a push: Loki answers 400
                self.send_response(400)
            else:
                self.server.lines += lines
                self.server.pushes += 1
                self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


_loki: list[LokiPush] = []


def loki_push() -> LokiPush:
    """The one push endpoint of this run (started at first use)."""
    if not _loki:
        _loki.append(LokiPush())
    return _loki[0]


def measure(args: argparse.Namespace, variant: str, work: Path, label: str,
            src: Path | None) -> dict[str, Any]:
    vdir = work / f"{label}-{variant}"
    (vdir / "run").mkdir(parents=True)
    endpoint = f"ipc://{vdir}/run/probe.sock"
    side = start_sidecar(endpoint, vdir, variant, src)
    engines: list[Any] = []
    rss_samples: list[tuple[float, float]] = []
    try:
        time.sleep(args.settle_s)
        rss_idle = rss_kib(side.pid)
        c0, t0 = threads_cpu_s(side.pid), time.monotonic()
        time.sleep(args.idle_s)
        idle_rate = (threads_cpu_s(side.pid) - c0) / (time.monotonic() - t0)
        engines = start_engines(args, endpoint, variant)
        names = [f"{variant}-e{i}" for i in range(args.engines)]
        for p in engines:
            p.stdin.write("\n")
            p.stdin.flush()
        time.sleep(args.skip_s)  # each engine's connection (its first rows) left out
        steps0 = sum((sidecar_engine(side.url, e) or {}).get("steps", 0) for e in names)
        rows0, own0 = counters(side.url)
        lines0 = loki_push().lines if _loki else 0
        spy = profile(side.pid, vdir / "pyspy.txt") if args.py_spy else None
        c0, t0, th0 = side.cpu_seconds(), time.monotonic(), os_threads(side.pid)
        rss_stop = threading.Event()
        sampler = sample_rss(side.pid, args.rss_every_s, rss_stop, rss_samples)
        results = [json.loads(p.stdout.readline()) for p in engines]
        want = dict(zip(names, (r["steps"] for r in results), strict=True))
        deadline = time.monotonic() + 120
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            seen = {e: sidecar_engine(side.url, e) or {} for e in want}
            if all(seen[e].get("steps", 0) >= n for e, n in want.items()):
                break
            time.sleep(0.05)
        c1, t1, th1 = side.cpu_seconds(), time.monotonic(), os_threads(side.pid)
        rss_stop.set()
        sampler.join(5)
        rss = rss_kib(side.pid)
        rows1, own1 = counters(side.url)
        lines1 = loki_push().lines if _loki else 0
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(30)
        metrics = scrape(side.url)
    finally:
        for e in engines:
            stop_process(e, 10, group=True)
        side.stop()
    steps = sum(s.get("steps", 0) for s in seen.values()) - steps0
    wall = t1 - t0
    busy = (c1 - c0) - idle_rate * wall
    rows = {k: rows1.get(k, 0.0) - rows0.get(k, 0.0) for k in rows1}
    store_rows = sum(v for k, v in rows.items() if k.startswith("clickhouse:"))
    out = {
        "variant": variant, "sidecar": label, "engines": args.engines, "steps": steps,
        "wall_s": wall,
        "sidecar_cpu_s": c1 - c0, "idle_cpu_per_s": idle_rate,
        "us_per_engine_step": busy / max(1, steps) * 1e6,
        "cores": busy / wall, "engine_steps_per_s": steps / wall / args.engines,
        "rows_per_s_per_engine": {k: v / wall / args.engines for k, v in rows.items()},
        "rows_per_step": {k: v / max(1, steps) for k, v in rows.items()},
        "store_rows_in_window": store_rows,
        "loki_lines_received": lines1 - lines0,
        "store_on": VARIANTS[variant] is not VARIANTS["off"],
        "rss_idle_kib": rss_idle["VmRSS"], "rss_kib": rss["VmRSS"], "hwm_kib": rss["VmHWM"],
        "rss_per_engine_kib": (rss["VmRSS"] - rss_idle["VmRSS"]) / args.engines,
        "rss_mib_samples": rss_samples,
        "engine_runs": results,
        "mismatches": sum(s.get("ledger_mismatches", 0) for s in seen.values()),
        "gaps": sum(s.get("ledger_gaps", 0) for s in seen.values()),
        "dropped": sum(s.get("probe_records_dropped", 0) for s in seen.values()),
        "metrics_lines": len(metrics),
        "cpu_s_by_os_thread": by_thread_name(th0, th1, side.pid),
        "own_metric_us_per_step": {k: round((v - own0.get(k, 0.0)) / max(1, steps) * 1e6, 1)
                                   for k, v in sorted(own1.items())},
        "kernel_cpu_s_by_os_thread": by_thread_name(th0, th1, side.pid, 2),
        "minor_faults_by_os_thread": by_thread_name(th0, th1, side.pid, 3),
    }
    if spy is not None and (vdir / "pyspy.txt").exists():
        out["py_spy"] = breakdown(vdir / "pyspy.txt")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variants", nargs="+", default=["on", "off"], choices=list(VARIANTS))
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--pool", type=int, default=NO_PREEMPT_POOL, help="blocks per engine")
    p.add_argument("--interval", type=float, default=0.0,
                   help="seconds between an engine's steps (0.01: at most 100 steps/s)")
    p.add_argument("--warm", type=int, default=200)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--rss-every-s", type=float, default=15.0,
                   help="seconds between RSS samples of the sidecar over the window")
    p.add_argument("--settle-s", type=float, default=3.0)
    p.add_argument("--skip-s", type=float, default=0.0,
                   help="start measuring this long after the engines start stepping")
    p.add_argument("--py-spy", action="store_true")
    p.add_argument("--against", type=Path, default=None,
                   help="also run another checkout's sidecar, each variant after this one's")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every variant (and --against) this many times over, in turn")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="kvscope-live-"))
    if args.out is not None:  # the sidecars' stores and logs go with the run (~20 MB)
        atexit.register(shutil.rmtree, work, True)
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"git": git_state(), "noise": machine_noise(), "runs": []}
    srcs: dict[str, Path | None] = {"this": None}
    if args.against is not None:
        srcs["against"] = args.against
    os.environ.pop("PYTHONPATH", None)
    print(f"{'sidecar':8} {'variant':8} {'steps':>6} {'steps/s':>8} {'us/step':>8} {'cores':>6} "
          f"{'rows/s/eng':>10} {'rss/eng MiB':>11} mism gaps drop")
    order = [(n, v, label) for n in range(args.rounds) for v in args.variants for label in srcs]
    for n, v, label in order:
        r = measure(args, v, work / f"round{n}" if args.rounds > 1 else work, label,
                    srcs[label])
        r["round"] = n
        summary["runs"].append(r)
        print(f"{label:8} {v:8} {r['steps']:6d} {r['engine_steps_per_s']:8.0f} "
              f"{r['us_per_engine_step']:8.0f} {r['cores']:6.3f} "
              f"{sum(r['rows_per_s_per_engine'].values()):10.0f} "
              f"{r['rss_per_engine_kib'] / 1024:11.1f} {r['mismatches']:4d} {r['gaps']:4d} "
              f"{r['dropped']:4d}", flush=True)
        if r["store_on"] and not r["store_rows_in_window"]:
            print(f"  no store insert landed in this {r['wall_s']:.0f} s window: the figure "
                  f"leaves the store's inserts out (run more --steps)")
        if r["loki_lines_received"]:
            print(f"  Loki push endpoint: {r['loki_lines_received']} lines received in the "
                  f"window, {r['loki_lines_received'] / r['wall_s']:.0f} a second")
        print("  RSS MiB over the window (s: MiB; idle {:.1f}):".format(
            r["rss_idle_kib"] / 1024), " ".join(f"{s:.0f}:{m:.0f}"
                                                for s, m in r["rss_mib_samples"]))
        print("  CPU s by OS thread:", r["cpu_s_by_os_thread"])
        print("  µs a step by thread, as the sidecar reports it:", r["own_metric_us_per_step"])
        print("    of which in the kernel:", r["kernel_cpu_s_by_os_thread"])
        print("  minor page faults by OS thread:", r["minor_faults_by_os_thread"])
        if "py_spy" in r:
            print("  py-spy threads:", r["py_spy"]["threads"])
            print("  py-spy inclusive:", r["py_spy"]["inclusive"])
    if args.rounds > 1:
        summary["rounds"] = spread(summary["runs"])
        for key, s in summary["rounds"].items():
            print(f"{key}: {s['n']} rounds, µs a step median {s['us_median']:.0f} "
                  f"({s['us_min']:.0f}-{s['us_max']:.0f}), cores median {s['cores_median']:.3f}, "
                  f"ingest µs a step {s['ingest_min']:.1f}-{s['ingest_max']:.1f}, "
                  f"steps/s {s['steps_s_min']:.0f}-{s['steps_s_max']:.0f}")
    write_summary(summary, out)
    for endpoint in _loki:
        endpoint.shutdown()
        endpoint.server_close()


def spread(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each sidecar and variant's median and range over the rounds."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(f"{r['sidecar']} {r['variant']}", []).append(r)
    out = {}
    for key, rs in groups.items():
        us = [r["us_per_engine_step"] for r in rs]
        ingest = [r["own_metric_us_per_step"].get("ingest", 0.0) for r in rs]
        rate = [r["engine_steps_per_s"] for r in rs]
        out[key] = {"n": len(rs), "us_median": statistics.median(us), "us_min": min(us),
                    "us_max": max(us),
                    "cores_median": statistics.median(r["cores"] for r in rs),
                    "ingest_min": min(ingest), "ingest_max": max(ingest),
                    "steps_s_min": min(rate), "steps_s_max": max(rate)}
    return out


if __name__ == "__main__":
    main()
