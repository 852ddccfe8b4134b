"""The embedded store's CPU by thread, busy and idle: as the sidecar opens it and inserts, or not.

    python benchmarks/store_background.py [--frames FILE | --running 256 --steps 6000]
        [--rate 281] [--batch-interval 5] [--busy-s 30] [--idle-s 30] [--rounds 2]
        [--variants embedded each default] [--insert-intervals 30 ...] [--out DIR]

One engine's recorded frames (``ingest_instructions``'s recording, or ``--frames``) are
replayed through the ``Hub`` and the request tracker once, their rows kept by table. Each
child process then opens a real ``ClickHouseSink`` on a fresh chDB directory as
``kvscope serve`` does (write-ahead spool, batches of ``--batch-interval``: serve's
default, 5 s) and hands it those rows at the recording's step rate (``--rate``, 281 steps
a second: what one engine at 256 running steps live here) for ``--busy-s``, then nothing
for ``--idle-s``. Per window: the CPU of
every thread of the process by name (``/proc/self/task/*/schedstat``, nanoseconds) and
how often each woke (its voluntary context switches), in ms of CPU and wake-ups a second;
the busy window ends once every row handed over is in the store (a ``flush``), its CPU
divided by the seconds rows were handed over.
Variants, alternated over ``--rounds``: ``embedded`` opens chDB with
``kvscope.store.embedded.EMBEDDED_OPTIONS``, inserts with its ``INSERT_SETTINGS`` and
combines a table's spooled batches into one insert every
``kvscope.sidecar.config.EMBEDDED_INSERT_INTERVAL_S`` (30 s), as the sidecar does (each of
``--insert-intervals`` in a run of its own when given); ``each``
the same but inserts each batch as it is spooled (the sidecar before the eighteenth pass);
``default`` opens and inserts with chDB's defaults, each batch as it is spooled.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


Reading = tuple[dict[int, tuple[str, float]], dict[int, tuple[str, int]]]
"""Each thread's name and CPU seconds (``sidecar_feed.schedstat``), and its voluntary
context switches: the times it went to sleep, so woke."""


def reading() -> Reading:
    from sidecar_feed import schedstat

    woke = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text().splitlines()
            n = next(int(line.split()[1]) for line in status
                     if line.startswith("voluntary_ctxt_switches:"))
        except (OSError, StopIteration):
            continue  # a thread that ended
        woke[int(task.name)] = (name, n)
    return schedstat(os.getpid()), woke


def window(before: Reading, seconds: float) -> dict[str, Any]:
    from sidecar_live import by_thread_name

    after = reading()
    cpu = by_thread_name(before[0], after[0], os.getpid())
    woke = by_thread_name(before[1], after[1], os.getpid())
    return {"ms_per_s": sum(cpu.values()) * 1e3 / seconds,
            "by_thread": {n: [round(v * 1e3 / seconds, 3), round(woke.get(n, 0) / seconds, 1)]
                          for n, v in cpu.items()}}


def rss_mib() -> dict[str, float]:
    """The process's resident memory now and at its peak, MiB."""
    status = dict(line.split(":", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def rows_of(path: Path) -> tuple[list[Any], int]:
    import msgspec
    from ingest_instructions import replay_hub

    frames = msgspec.msgpack.decode(path.read_bytes(), type=list[list[bytes]])
    rows: list[Any] = []
    hub = replay_hub(rows.append)
    for parts in frames:
        hub.accept(parts)
    return rows, next(iter(hub.engines.values())).counters.steps


def child(path: Path, variant: str, busy_s: float, idle_s: float, rate: float,
          interval_s: float, insert_s: float) -> dict[str, Any]:
    import kvscope.store.embedded as embedded
    from kvscope.rows import table_of
    from kvscope.sinks.options import DeliveryOptions
    from kvscope.store.sink import ClickHouseSink

    if variant == "default":  # chDB as clickhouse-connect opens it, inserts as sent
        embedded.EMBEDDED_OPTIONS = {}
        embedded.INSERT_SETTINGS = {}
    rows, steps = rows_of(path)
    per_s = len(rows) / steps * rate
    home = Path(tempfile.mkdtemp(prefix="kvscope-store-bg-"))
    insert_s = insert_s if variant == "embedded" else 0.0
    sink = ClickHouseSink(f"chdb://{home / 'chdb'}", spool_dir=str(home / "spool"),
                          options=DeliveryOptions(batch_interval_s=interval_s,
                                                  insert_interval_s=insert_s))
    sink.client()  # opened and the schema applied, as kvscope serve does at start
    time.sleep(1.0)
    out: dict[str, Any] = {"variant": variant, "insert_interval_s": insert_s,
                           "rows_per_s": per_s}
    before, t0, sent = reading(), time.monotonic(), 0
    while (now := time.monotonic() - t0) < busy_s:
        for i in range(sent, int(now * per_s)):  # the recording again once it ends
            row = rows[i % len(rows)]
            sink.write(table_of(row), row)
            sent = i + 1
        time.sleep(0.1)
    seconds = time.monotonic() - t0
    sink.flush(60.0)  # the window's rows all inserted, whatever the insert interval
    out["busy"] = window(before, seconds)
    out["busy"]["rows"] = sink.stats().rows_written
    out["busy"]["rss_mib"] = rss_mib()
    before, t0 = reading(), time.monotonic()
    time.sleep(idle_s)
    out["idle"] = window(before, time.monotonic() - t0)
    out["idle"]["rss_mib"] = rss_mib()
    sink.close(10.0)
    return out


def main() -> None:
    if len(sys.argv) == 9 and sys.argv[1] == "--child":
        sys.path.insert(0, str(HERE))
        print(json.dumps(child(Path(sys.argv[2]), sys.argv[3], *map(float, sys.argv[4:]))))
        return
    from ingest_instructions import add_recording_args, child_env, decoding_recording

    from kvscope.settings import default
    from kvscope.sidecar.config import EMBEDDED_INSERT_INTERVAL_S

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_recording_args(p)
    p.add_argument("--rate", type=float, default=281.0, help="engine steps a second")
    p.add_argument("--batch-interval", type=float,
                   default=default("clickhouse_batch_interval_s"),
                   help="seconds a table's rows gather (kvscope serve's default)")
    p.add_argument("--busy-s", type=float, default=30.0)
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["embedded", "each"],
                   choices=["embedded", "each", "default"])
    p.add_argument("--insert-intervals", type=float, nargs="+",
                   default=[EMBEDDED_INSERT_INTERVAL_S],
                   help="embedded: seconds a table's spooled batches wait to be one insert "
                        "(one run of the variant each)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-store-bg-"))
    out.mkdir(parents=True, exist_ok=True)
    path = decoding_recording(args, out)
    results = []
    print("variant        window  ms CPU/s  by thread (ms/s, wake-ups/s)")
    runs = [(v, s) for v in args.variants
            for s in (args.insert_intervals if v == "embedded" else [0.0])]
    for _ in range(args.rounds):
        for variant, insert_s in runs:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__)), "--child", str(path), variant,
                 str(args.busy_s), str(args.idle_s), str(args.rate), str(args.batch_interval),
                 str(insert_s)],
                env=child_env(ROOT / "exporter"), capture_output=True, text=True, check=True)
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(got)
            for w in ("busy", "idle"):
                top = ", ".join(f"{n} {c:.2f} ({k:g})"
                                for n, (c, k) in list(got[w]["by_thread"].items())[:7])
                rss = got[w]["rss_mib"]
                name = f"{variant}:{insert_s:g}" if variant == "embedded" else variant
                print(f"{name:13s}  {w:6s}  {got[w]['ms_per_s']:8.2f}  RSS {rss['VmRSS']:.0f} "
                      f"(peak {rss['VmHWM']:.0f}) MiB  {top}")
    summary = {"bench": "store_background", "frames": str(path), "results": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
