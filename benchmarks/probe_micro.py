"""Microbenchmarks of the probe and the sidecar on a recorded stream of real steps.

vLLM's real scheduler (the twin) runs with the probe attached until the batch is full,
then records a window of steps: each step's ``SchedulerOutput`` and the wire records the
probe made of it. Each part is then replayed on its own in this one process and timed
many times; the figure per step is the MINIMUM over the repetitions (noise on a busy
2-core machine only ever adds time), then p50 / p99 over the window's steps:

- ``record``: ``Recorder.on_step`` on the engine thread (the columnar step record,
  encoded there; the window's block ops and wrappers are not replayed: see ``self``);
- ``engine``: everything the probe does on the engine thread per step, replayed call by
  call (``micro_floor.py``): its pool wrappers around the step's recorded pool calls, the
  blocks-needed hook while armed, ``schedule()``'s wrapper and the record, vLLM's own
  work excluded; ``unencoded``: the same with the records kept as structs, not encoded
  (not a probe that could run: they hold vLLM's lists; ``engine`` minus it is what
  encoding costs); ``floor``: the same calls through the least a probe must do to keep the
  sidecar's ledger exact (what it leaves out: ``micro_floor.py``); ``calls/st``: pool
  calls per step + allocations the armed hook saw;
- ``self``: the probe's own per-step report from the real run (``Step.probe_ns``: the
  step record and the wrappers' handlers, wall clock, plus the untimed call layers as
  calls x calibrated costs; one run: noisy, not a minimum);
- ``encode``: the sender thread's work: frames of ``--batch`` encoded steps built and
  encoded around them, per step; ``send floor``: one wakeup and one ZMQ send per frame,
  the sending thread's CPU, per step (the least a sender can do);
- ``ingest``: the sidecar's work for 8 engines replaying the window (decode, hub, ledger,
  request tracker), CPU time per engine step;
- ``scrape``: ``/metrics`` for those 8 engines (collect + exposition), p50 / p99 of the
  minima over repetitions.

    python benchmarks/probe_micro.py [--quick] [--reps N] [--steps N] [--out DIR]

Reported, never asserted. Whole-engine ratios (probe on / off, separate processes) come
from ``probe_step_cost.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _common import machine_noise, percentile
from micro_floor import CallLog, engine_and_floor, send_floor_us
from twin_run import workload

_now = time.perf_counter_ns
_cpu = time.process_time_ns
ENGINES = 8
WARMUP = 1500


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--steps", type=int, default=200, help="recorded steps per shape")
    p.add_argument("--batch", type=int, default=20, help="steps per frame (sender batching)")
    p.add_argument("--cold", action="store_true",
                   help="also replay engine and floor with unrelated Python work between "
                        "steps (micro_floor.cool), as vLLM's scheduling is in place")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def shapes(quick: bool) -> list[tuple[int, int]]:
    """(pool blocks, running requests): the issue's batches, the pools from 4k to 128k."""
    if quick:
        return [(4096, 256), (32768, 256)]
    return [(32768, 32), (32768, 128), (4096, 256), (32768, 256), (131072, 256)]


def record_window(pool: int, seqs: int, steps: int) -> dict[str, Any]:
    """Run the twin with the probe until ``seqs`` requests run; keep ``steps`` steps."""
    from kvscope.twin import TwinConfig
    from kvscope.twin.probed import ProbedTwin

    cfg = TwinConfig(block_size=32, num_blocks=pool, max_num_seqs=seqs,
                     max_num_batched_tokens=8192, max_model_len=4096, policy="fcfs",
                     enable_prefix_caching=True)
    pt = ProbedTwin(cfg, keyframe_interval_s=1e9)
    outs: list[Any] = []
    steps_rec: list[Any] = []
    calls: list[tuple[list[Any], int]] = []
    head: list[Any] = []
    sched = pt.scheduler
    rec = pt.rec
    log: list[CallLog] = []

    def on_step(i: int, out: Any) -> None:
        """This step's records are in the ring now: keep them with the step's output.
        The window starts when the batch is full, or at step WARMUP in a pool too small
        to hold a full batch (it preempts instead)."""
        records = [data for _, data in rec.ring]
        rec.ring.clear()
        rec.popped_bytes = rec.pushed_bytes
        if not head and (len(sched.running) >= int(seqs * 0.95) or i >= WARMUP):
            rec.keyframe(_now())  # the state the window starts from
            head.append(_decode(rec.ring.popleft()[1]))
            rec.popped_bytes = rec.pushed_bytes
            log.append(CallLog(rec))
        elif head:
            outs.append(out)
            calls.append(log[0].take())
            steps_rec.append(next(r for r in map(_decode, records)
                                  if type(r).__name__ == "Step"))
            if len(outs) >= steps:
                raise _Enough()

    pt.drain = lambda: None  # type: ignore[method-assign]
    try:
        pt.run(workload(4000), on_step=on_step, max_steps=20000)
    except _Enough:
        pass
    return {"pt": pt, "outs": outs, "steps": steps_rec, "keyframe": head[0], "calls": calls,
            "preemptions": sum(len(o.preempted_req_ids) for o in outs)}


def _decode(data: bytes) -> Any:
    import msgspec

    from kvscope_probe import wire

    return msgspec.msgpack.decode(data, type=wire.Record)


class _Enough(Exception):
    """The window is recorded."""


def time_record(pt: Any, outs: list[Any], reps: int) -> list[float]:
    """Per step: the fastest ``on_step`` over ``reps`` replays, in microseconds."""
    rec = pt.rec
    rec.next_keyframe_ns = 1 << 62
    best = [float("inf")] * len(outs)
    for _ in range(reps):
        for i, out in enumerate(outs):
            t0 = _now()
            rec.on_step(out, 0, t0)
            dt = _now() - t0
            rec.ring.clear()
            rec.popped_bytes = rec.pushed_bytes
            rec.want_keyframe = False
            best[i] = min(best[i], dt / 1e3)
    return best


def frames_of(steps: list[Any], batch: int, engine: str, session: str) -> list[Any]:
    from kvscope_probe import wire

    return [wire.Frame(engine, session, i + 2, 0, 0, steps[i:i + batch])
            for i in range(0, len(steps), batch)]


def time_encode(steps: list[Any], batch: int, reps: int) -> float:
    """The sender thread's work: fastest framing + encoding of all frames over ``reps``
    (the records come encoded from the engine thread), per step, in microseconds."""
    from types import SimpleNamespace

    import msgspec

    from kvscope_probe import sender, wire

    rec: Any = SimpleNamespace(hello=SimpleNamespace(engine="0", session="s"),
                               ring_dropped=0, send_dropped=0, faults=0, pushed_bytes=0,
                               popped_bytes=0, ring_bytes=0)
    encoded = [msgspec.msgpack.encode(s) for s in steps]
    best = float("inf")
    for _ in range(reps):
        t0 = _now()
        for i in range(0, len(encoded), batch):
            wire.encode(sender.make_frame(rec, i, encoded[i:i + batch]))
        best = min(best, (_now() - t0) / 1e3 / len(steps))
    return best


def engine_stream(kf: Any, steps: list[Any], batch: int, k: int) -> list[list[bytes]]:
    """Engine ``k``'s encoded frames: its hello and the keyframe the window starts from,
    then the window's steps."""
    import msgspec

    from kvscope_probe import wire

    hello = msgspec.structs.replace(kf.hello, engine=f"e{k}", session=f"s{k}")
    kf = msgspec.structs.replace(kf, hello=hello)
    head = wire.Frame(hello.engine, hello.session, 0, 0, 0, [hello, kf])
    return [wire.encode(head)] + [wire.encode(f) for f in
                                  frames_of(steps, batch, hello.engine, hello.session)]


def _discard(_row: object) -> None:
    """Rows go nowhere: the store's cost is measured by clickhouse_sink.py."""


def time_ingest(streams: list[list[list[bytes]]], n_steps: int, reps: int
                ) -> tuple[float, float, float, Any]:
    """Fastest CPU time per engine step to ingest every stream (interleaved by frame),
    and the /metrics p50 / p99 (ms) over the 8 engines it left, from the last rep."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvscope.sidecar.exposition.metrics import KVScopeCollector
    from kvscope.state.hub import Hub
    from kvscope.state.requests import RequestTracker

    best = float("inf")
    hub: Any = None
    for _ in range(reps):
        hub = Hub()
        hub.listeners.append(RequestTracker(_discard).on_event)
        for s in streams:  # hellos and keyframes: not per-step work
            hub.accept(s[0])
        gc.collect()
        c0 = _cpu()
        for i in range(1, max(len(s) for s in streams)):
            for s in streams:
                if i < len(s):
                    hub.accept(s[i])
        best = min(best, (_cpu() - c0) / 1e3 / (len(streams) * n_steps))
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub))
    scrape = []
    for _ in range(max(reps, 20)):
        t0 = _now()
        generate_latest(reg)
        scrape.append((_now() - t0) / 1e6)
    return best, percentile(scrape, 0.5), percentile(scrape, 0.99), hub


def measure(pool: int, seqs: int, args: argparse.Namespace) -> dict[str, Any]:
    w = record_window(pool, seqs, args.steps)
    outs, steps = w["outs"], w["steps"]
    record = time_record(w["pt"], outs, args.reps)
    calls = w["calls"]
    replayed = [(o, c) for o, (c, _) in zip(outs, calls, strict=True)]
    armed = [a for _, a in calls]
    rec = w["pt"].rec
    ef = engine_and_floor(rec, replayed, armed, args.reps)
    cold = engine_and_floor(rec, replayed, armed, args.reps, cold=True) if args.cold else None
    streams = [engine_stream(w["keyframe"], steps, args.batch, k) for k in range(ENGINES)]
    ingest, scrape50, scrape99, hub = time_ingest(streams, len(steps), max(3, args.reps // 5))
    synced = all(st.ledger.synced and st.counters.ledger_mismatches == 0
                 for st in hub.engines.values()) and len(hub.engines) == ENGINES
    wire_bytes = sum(len(p[1]) for s in streams[:1] for p in s[1:]) / len(steps)
    return {
        "pool": pool, "max_num_seqs": seqs, "steps": len(steps),
        "reqs_per_step": sum(len(o.num_scheduled_tokens) for o in outs) / len(outs),
        "preemptions": w["preemptions"],
        "record_p50_us": percentile(record, 0.5), "record_p99_us": percentile(record, 0.99),
        "engine_p50_us": percentile(ef["engine"], 0.5),
        "engine_p99_us": percentile(ef["engine"], 0.99),
        "unencoded_p50_us": percentile(ef["unencoded"], 0.5),
        "floor_p50_us": percentile(ef["floor"], 0.5),
        "floor_p99_us": percentile(ef["floor"], 0.99),
        **({"engine_cold_p50_us": percentile(cold["engine"], 0.5),
            "engine_cold_p99_us": percentile(cold["engine"], 0.99),
            "unencoded_cold_p50_us": percentile(cold["unencoded"], 0.5),
            "floor_cold_p50_us": percentile(cold["floor"], 0.5),
            "floor_cold_p99_us": percentile(cold["floor"], 0.99)} if cold else {}),
        "pool_calls_per_step": sum(len(c) for c, _ in calls) / len(outs),
        "need_calls_per_step": sum(a for _, a in calls) / len(outs),
        "need_hook_ns": ef["need_hook_ns"][0],
        "self_p50_us": percentile([s.probe_ns / 1e3 for s in steps], 0.5),
        "self_p99_us": percentile([s.probe_ns / 1e3 for s in steps], 0.99),
        "encode_us": time_encode(steps, args.batch, args.reps),
        "send_floor_us": send_floor_us(streams[0][1:], args.reps) / args.batch,
        "ingest_us": ingest, "scrape_p50_ms": scrape50, "scrape_p99_ms": scrape99,
        "wire_bytes_per_step": wire_bytes, "synced_8": synced,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.reps, args.steps = min(args.reps, 10), min(args.steps, 100)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    noise = machine_noise()
    rows = [measure(pool, seqs, args) for pool, seqs in shapes(args.quick)]
    head = ("pool", "seqs", "reqs/st", "pre", "calls/st", "record p50/p99 us",
            "engine p50/p99 us", "unencoded p50", "floor p50/p99 us", "self p50/p99 us",
            "encode us",
            "send floor us", "ingest us (8 eng)", "scrape p50/p99 ms", "wire B/st", "synced")
    print(" | ".join(head))
    for r in rows:
        print(f"{r['pool']} | {r['max_num_seqs']} | {r['reqs_per_step']:.0f} | "
              f"{r['preemptions']} | {r['pool_calls_per_step']:.1f}"
              f" +{r['need_calls_per_step']:.0f} | "
              f"{r['record_p50_us']:.1f} / {r['record_p99_us']:.1f} | "
              f"{r['engine_p50_us']:.1f} / {r['engine_p99_us']:.1f} | "
              f"{r['unencoded_p50_us']:.1f} | "
              f"{r['floor_p50_us']:.1f} / {r['floor_p99_us']:.1f} | "
              f"{r['self_p50_us']:.1f} / {r['self_p99_us']:.1f} | {r['encode_us']:.1f} | "
              f"{r['send_floor_us']:.2f} | "
              f"{r['ingest_us']:.1f} | {r['scrape_p50_ms']:.2f} / {r['scrape_p99_ms']:.2f} | "
              f"{r['wire_bytes_per_step']:.0f} | {r['synced_8']}")
    if args.cold:
        print("cold (micro_floor.cool between steps): pool | seqs | engine p50/p99 us | "
              "unencoded p50 | floor p50/p99 us")
        for r in rows:
            print(f"{r['pool']} | {r['max_num_seqs']} | {r['engine_cold_p50_us']:.1f} / "
                  f"{r['engine_cold_p99_us']:.1f} | {r['unencoded_cold_p50_us']:.1f} | "
                  f"{r['floor_cold_p50_us']:.1f} / {r['floor_cold_p99_us']:.1f}")
    summary = {"bench": "probe_micro", "reps": args.reps, "noise": noise, "rows": rows}
    print(json.dumps(summary))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
