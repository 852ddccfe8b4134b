"""Engine-thread work per step while the sidecar is connected, away, and after a fault.

vLLM's real scheduler (the twin) with the probe's Recorder bound, its sender drained in
the engine loop after each step (never started as a thread) into a Hub. The hooks' clock
advances 25 ms per call (50 ms a step), so the outage is 60 s of probe time on any
machine. Phases: connected, away (every send dropped), connected again, then one
contained fault in a BlockPool hook. Per phase: steps, keyframes built, the most and the
total pool blocks the engine thread read (``PoolMirror`` scans, counted), and the
engine thread's CPU in ``Recorder.on_step`` (``time.thread_time_ns``) per step.

    .venv/bin/python benchmarks/recovery.py [--blocks N] [--requests N]

Run it against another checkout's probe with ``PYTHONPATH=<checkout>/exporter``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvscope.state.hub import Hub
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.engine import Twin
from kvscope_probe import hooks, plugin, sender, transport
from kvscope_probe.mirror import PoolMirror
from kvscope_probe.recorder import Recorder

STEP_CALL_NS = 25_000_000
PHASES = (("connected", 200), ("away", 1200), ("back", 200), ("fault", 200))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=32768)
    ap.add_argument("--requests", type=int, default=2000)
    a = ap.parse_args()
    clock = {"ns": 10**12}

    def now() -> int:
        clock["ns"] += STEP_CALL_NS
        return clock["ns"]

    hooks._now_ns = now
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=a.blocks), seed=3)
    sched = twin.scheduler
    rec = Recorder(sched, ring_size=1 << 20, keyframe_interval_s=5.0)
    plugin.bind(sched, rec)
    rec.push(rec.hello)
    rec.keyframe(now())
    hub = Hub()
    snd = sender.Sender(rec, "inproc://unused")
    snd._sock = object()
    state = {"away": False, "reads": 0, "kf": 0, "cpu": 0, "fault": False}

    def send(_sock: Any, parts: list[bytes], _wait_ms: int) -> bool:
        if state["away"]:
            return False
        hub.accept(parts)
        return True

    transport.send = send
    full = PoolMirror._scan_states
    part = getattr(PoolMirror, "_scan_range", None)

    def scan_states(self: PoolMirror) -> bytearray:
        state["reads"] += len(self.pool.blocks)
        state["nested"] = True
        try:
            return full(self)
        finally:
            state["nested"] = False

    PoolMirror._scan_states = scan_states  # type: ignore[method-assign]
    if part is not None:
        def scan_range(self: PoolMirror, states: bytearray, lo: int, hi: int) -> int:
            if not state.get("nested"):
                state["reads"] += len(self.pool.blocks[lo:hi])
            return part(self, states, lo, hi)
        PoolMirror._scan_range = scan_range  # type: ignore[attr-defined]
    real_kf, real_step, real_free = Recorder.keyframe, Recorder.on_step, PoolMirror.on_free

    def keyframe(self: Recorder, t: int) -> None:
        before = self.seq
        real_kf(self, t)
        state["kf"] += self.seq > before

    def on_step(self: Recorder, *args: Any) -> None:
        t0 = time.thread_time_ns()
        real_step(self, *args)
        state["cpu"] += time.thread_time_ns() - t0

    def on_free(self: PoolMirror, blocks: Any) -> None:
        if state["fault"]:
            state["fault"] = False
            raise RuntimeError("injected")
        real_free(self, blocks)

    Recorder.keyframe, Recorder.on_step = keyframe, on_step  # type: ignore[method-assign]
    PoolMirror.on_free = on_free  # type: ignore[method-assign]
    rows: dict[str, dict[str, Any]] = {}
    bounds = []
    n = 0
    for name, k in PHASES:
        bounds.append((n, n + k, name))
        n += k
    steps: list[tuple[str, int, int, int]] = []  # (phase, reads, keyframes, cpu ns)

    def schedule(*args: Any, **kwargs: Any) -> Any:
        i = len(steps)
        phase = next((nm for lo, hi, nm in bounds if lo <= i < hi), "tail")
        state["away"] = phase == "away"
        if phase == "fault" and i == bounds[3][0]:
            state["fault"] = True
        state["reads"] = state["kf"] = state["cpu"] = 0
        out = type(sched).schedule(sched, *args, **kwargs)
        snd.drain_once()
        steps.append((phase, state["reads"], state["kf"], state["cpu"]))
        return out

    sched.schedule = schedule
    twin.run(generate(WorkloadSpec(n_requests=a.requests, seed=1)))
    led = hub.engines[rec.hello.engine].ledger
    for name, _ in (*PHASES, ("tail", 0)):
        ph = [s for s in steps if s[0] == name]
        if not ph:
            continue
        cpu = sorted(s[3] for s in ph)
        rows[name] = {"steps": len(ph), "keyframes": sum(s[2] for s in ph),
                      "max_blocks_read": max(s[1] for s in ph),
                      "blocks_read": sum(s[1] for s in ph),
                      "cpu_us_mean": round(sum(cpu) / len(cpu) / 1e3, 1),
                      "cpu_us_p99": round(cpu[int(0.99 * (len(cpu) - 1))] / 1e3, 1),
                      "cpu_us_max": round(cpu[-1] / 1e3, 1)}
    print(f"{'phase':10} {'steps':>6} {'keyfr':>6} {'maxread':>8} {'reads':>8} "
          f"{'cpu mean/p99/max us':>22}")
    for name, r in rows.items():
        print(f"{name:10} {r['steps']:6} {r['keyframes']:6} {r['max_blocks_read']:8} "
              f"{r['blocks_read']:8} {r['cpu_us_mean']:8}/{r['cpu_us_p99']}/{r['cpu_us_max']}")
    print(json.dumps({"blocks": a.blocks, "probe": plugin.__file__, "faults": rec.faults,
                      "send_dropped": rec.send_dropped, "ledger_synced": led.synced,
                      "phases": rows}))


if __name__ == "__main__":
    main()
