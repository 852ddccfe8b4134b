"""The worker side of ``probe_step_cost.py``: time the twin's steps in one process.

Run only as ``probe_step_cost.py --worker off|on``: importing vLLM happens inside
``run_worker``, and with ``on`` the probe's hooks are installed for the rest of the
process, which is why each mode gets a process of its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from array import array
from pathlib import Path
from typing import Any

from _common import percentile, process_cpu_s, scrape, wait_engine_steps

POOLS = (4096, 32768, 131072)
_now = time.perf_counter_ns
_cpu = time.thread_time_ns
KEYFRAME_REPEATS = 30


def thread_cpu_ns(native_id: int) -> int:
    """CPU time of one thread of this process so far (Linux schedstat, in ns)."""
    return int(Path(f"/proc/self/task/{native_id}/schedstat").read_text().split()[0])


def twin_config(pool: int) -> Any:
    from kvscope.twin import TwinConfig

    # 256 seats of up to 4096 tokens (128 blocks): the 4k pool preempts, and the
    # workload below passes enough tokens through every pool to use each block.
    return TwinConfig(block_size=32, num_blocks=pool, max_num_seqs=256,
                      max_num_batched_tokens=8192, max_model_len=4096, policy="fcfs",
                      enable_prefix_caching=True)


def workload(n: int) -> list[Any]:
    from kvscope.twin import WorkloadSpec, generate

    # ~2,000 tokens per request on average; 8 requests arrive every 12 steps.
    return generate(WorkloadSpec(
        n_requests=n, short_fraction=0.3, short_prompt=(64, 512), long_prompt=(1000, 3000),
        shared_prefix_fraction=0.5, shared_prefix_len=512, max_tokens=(64, 768),
        waves=max(1, n // 8), wave_interval_steps=12, priorities=(0, 0), seed=0))


class StepTimer:
    """Times every call of the scheduler's ``schedule``, ``update_from_output`` and
    ``add_request`` through instance attributes that shadow the class's methods (the
    probe's wrappers when it is on, vLLM's own when off): the same code in both modes.

    ``schedule`` gets wall time and the engine thread's own CPU time: the latter is
    blind to other processes taking the core and to waits for the GIL."""

    def __init__(self, sched: Any) -> None:
        cls = type(sched)
        o_schedule, o_update, o_add = cls.schedule, cls.update_from_output, cls.add_request
        self.schedule_ns, self.update_ns, self.add_ns = array("q"), array("q"), array("q")
        self.schedule_cpu_ns = array("q")

        def schedule() -> Any:
            c0 = _cpu()
            t0 = _now()
            out = o_schedule(sched)
            t1 = _now()
            self.schedule_cpu_ns.append(_cpu() - c0)
            self.schedule_ns.append(t1 - t0)
            return out

        def update_from_output(out: Any, model_output: Any) -> Any:
            t0 = _now()
            ret = o_update(sched, out, model_output)
            self.update_ns.append(_now() - t0)
            return ret

        def add_request(request: Any) -> Any:
            t0 = _now()
            ret = o_add(sched, request)
            self.add_ns.append(_now() - t0)
            return ret

        sched.schedule, sched.update_from_output = schedule, update_from_output
        sched.add_request = add_request


class GcTimer:
    """Wall time the collector ran on any thread (gc.callbacks), and how often."""

    def __init__(self) -> None:
        self.ns = self.runs = 0
        self._t0 = 0

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = _now()
        else:
            self.ns += _now() - self._t0
            self.runs += 1

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


class FillTracker:
    """How full the pool got, read between steps (outside the timed calls)."""

    def __init__(self, sched: Any) -> None:
        self.pool = sched.kv_cache_manager.block_pool
        self.usable = self.pool.num_gpu_blocks - 1
        self.peak_used = self.peak_step = self.max_block_id = self.given = 0
        self.scheduled_reqs = 0

    def on_step(self, i: int, out: Any) -> None:
        self.scheduled_reqs += len(out.num_scheduled_tokens)
        used = self.usable - self.pool.get_num_free_blocks()
        if used > self.peak_used:
            self.peak_used, self.peak_step = used, i
        groups = [g for r in out.scheduled_new_reqs for g in r.block_ids]
        groups += [g for nb in out.scheduled_cached_reqs.new_block_ids if nb for g in nb]
        for g in groups:
            if g:
                self.given += len(g)
                self.max_block_id = max(self.max_block_id, max(g))


def run_pool(args: argparse.Namespace, pool: int, requests: list[Any]) -> dict[str, Any]:
    from kvscope.twin.engine import Twin

    engine = f"{args.tag}r{args.round}-{pool}"
    os.environ["KVSCOPE_ENGINE"] = engine  # read when the probe attaches
    gc.collect()
    twin = Twin(twin_config(pool), seed=0)
    watch = ProbeWatch(args, twin.scheduler, engine) if args.worker == "on" else None
    timer, fill = StepTimer(twin.scheduler), FillTracker(twin.scheduler)
    gc_timer = GcTimer()
    cpu0 = time.process_time_ns()  # every thread of this process: the engine's and the sender's
    main0 = _cpu()
    with gc_timer:
        res = twin.run(requests, on_step=fill.on_step)
    main_cpu_ns = _cpu() - main0
    proc_cpu_ns = time.process_time_ns() - cpu0
    sched_ns, upd_ns = list(timer.schedule_ns), list(timer.update_ns)
    out: dict[str, Any] = {
        "steps": res.steps, "preemptions": res.preemptions, "finished": res.finished,
        "wall_s": res.wall_seconds, "schedule_ns": sched_ns, "proc_cpu_ns": proc_cpu_ns,
        "schedule_cpu_ns": list(timer.schedule_cpu_ns),
        "step_ns": [s + u for s, u in zip(sched_ns, upd_ns, strict=True)],
        "main_cpu_ns": main_cpu_ns, "gc_ns": gc_timer.ns, "gc_runs": gc_timer.runs,
        "add_mean_ns": sum(timer.add_ns) / max(1, len(timer.add_ns)),
        "peak_used_ratio": fill.peak_used / fill.usable,
        "pool_reach_ratio": fill.max_block_id / fill.usable,
        "blocks_given_per_usable_block": fill.given / fill.usable,
        "scheduled_reqs_per_step": fill.scheduled_reqs / max(1, res.steps),
    }
    if watch is not None:
        out["probe"] = watch.report(res.steps)
        out["probe"]["keyframe"] = keyframe_cost(pool, requests, fill.peak_step)
    print(f"pool {pool}: {res.steps} steps, {res.preemptions} preemptions, "
          f"schedule p50 {percentile(sched_ns, 0.5) / 1e3:.1f} us, "
          f"wall {res.wall_seconds:.1f} s", flush=True)
    return out


class ProbeWatch:
    """Attaches the probe to a scheduler before the timed run, as its first hook call
    would (a one-off full scan of the pool, a sender thread), and afterwards collects
    what the probe, its sender thread and the sidecar say about the run."""

    def __init__(self, args: argparse.Namespace, sched: Any, engine: str) -> None:
        from kvscope_probe import plugin

        self.args, self.sched, self.engine = args, sched, engine
        t0 = _now()
        if plugin.attach(sched) is None:
            raise SystemExit("the probe did not attach to the twin's scheduler")
        self.attach_ns = _now() - t0
        self.sender = plugin._senders[-1]  # the thread attach() just started
        self.sender_cpu0 = thread_cpu_ns(self.sender.native_id)
        self.sidecar_cpu0 = process_cpu_s(args.sidecar_pid)

    def report(self, steps: int) -> dict[str, Any]:
        from kvscope_probe import plugin

        rec = self.sched._kvscope
        deadline = time.monotonic() + 30
        while rec.ring and time.monotonic() < deadline:
            time.sleep(0.01)
        url = self.args.sidecar_url  # empty: a sink (no sidecar figures to read)
        seen = (wait_engine_steps(url, self.engine, steps) or {}) if url else {}
        sender_cpu = thread_cpu_ns(self.sender.native_id) - self.sender_cpu0
        sidecar_cpu = process_cpu_s(self.args.sidecar_pid) - self.sidecar_cpu0
        metrics = scrape(url, by="thread") if url else {}
        plugin.stop_all()
        return {
            "attach_ns": self.attach_ns,
            "sender_cpu_ns": sender_cpu,
            "sidecar_cpu_s": sidecar_cpu,
            "recorder": {"ring_dropped": rec.ring_dropped, "send_dropped": rec.send_dropped,
                         "faults": rec.faults, "records": rec.seq},
            "sidecar": {k: seen.get(k, 0) for k in (
                "steps", "probe_records_dropped", "ledger_mismatches", "ledger_gaps",
                "probe_faults", "synced")},
            # the probe's own report, engine thread (the sender's and libzmq's apart)
            "overhead_s": metrics.get(
                ("kvscope_probe_overhead_seconds_total", self.engine, "engine"), 0.0),
            "overhead_by_thread_s": {
                t: v for (name, eng, t), v in metrics.items()
                if name == "kvscope_probe_overhead_seconds_total" and eng == self.engine},
        }


def keyframe_cost(pool: int, requests: list[Any], peak_step: int) -> dict[str, Any]:
    """Time ``Recorder.keyframe`` in-process with the pool as full as it got in the run.

    A fresh twin replays the run up to its fullest step with a Recorder bound by hand
    (no sender: its ring is emptied after every step), then keyframes repeatedly.
    """
    from kvscope.twin.engine import Twin
    from kvscope_probe import plugin
    from kvscope_probe.recorder import Recorder

    twin = Twin(twin_config(pool), seed=0)
    sched = twin.scheduler
    rec = Recorder(sched, ring_size=1 << 20, keyframe_interval_s=3600)
    plugin.bind(sched, rec)
    twin.run(requests, on_step=lambda i, o: rec.ring.clear(), max_steps=peak_step + 1)
    times = []
    for _ in range(KEYFRAME_REPEATS):
        t0 = _now()
        rec.keyframe(t0)
        times.append(_now() - t0)
        rec.ring.clear()
    scans = []
    for _ in range(3):
        t0 = _now()
        rec._scan_states()  # the full scan the probe does only after a contained fault
        scans.append(_now() - t0)
    get_ids = sched.kv_cache_manager.get_block_ids
    return {
        "p50_ns": percentile(times, 0.5), "max_ns": max(times), "full_scan_ns": min(scans),
        "running": len(sched.running),
        "table_blocks": sum(len(g) for r in sched.running for g in get_ids(r.request_id)),
    }


def warm_up(args: argparse.Namespace, requests: list[Any]) -> None:
    """A short run so first-call costs (lazy imports, the sender's socket) are paid."""
    from kvscope.twin.engine import Twin

    os.environ["KVSCOPE_ENGINE"] = f"warmup-{args.tag}r{args.round}"
    Twin(twin_config(POOLS[0]), seed=0).run(requests[:200], max_steps=400)
    if args.worker == "on":
        from kvscope_probe import plugin

        time.sleep(0.5)
        plugin.stop_all()


def run_worker(args: argparse.Namespace) -> None:
    import kvscope.twin.engine  # noqa: F401 - imports vLLM before the timed part

    if args.worker == "on":
        from kvscope_probe import plugin

        if not plugin.enable(args.endpoint):
            raise SystemExit("the probe's hooks could not be installed")
    requests = workload(args.requests)
    print(f"probe {args.worker}, round {args.round}, {len(requests)} requests", flush=True)
    warm_up(args, requests)
    result = {"mode": args.worker, "round": args.round,
              "pools": {str(p): run_pool(args, p, requests) for p in args.pools}}
    args.result.write_text(json.dumps(result))
