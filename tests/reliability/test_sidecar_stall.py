"""Properties 2 and 3: a stalled, killed or restarted sidecar never holds vLLM up.

vLLM's real scheduler (the twin) steps every 2 ms on a thread of the test, the probe
streaming to a real ``kvscope serve`` child. The child is frozen with SIGSTOP for 30 s, or
killed with SIGKILL and replaced by a new one on the same endpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvscope.layout.snapshot import decode_runs
from kvscope_probe import plugin
from kvscope_probe.recorder import FORCED_KEYFRAME_GAP_S, Recorder
from tests.reliability.serveproc import ServeProcess, wait_until
from tests.reliability.twindrive import TwinDriver, percentile
from tests.twin.waits import threads_that_wait

pytestmark = [pytest.mark.reliability, pytest.mark.twin]
pytest.importorskip("kvscope.twin.engine")

STOP_S = 30.0
STOP_MAX_S = 90.0
STEP_S = 0.002
SERVE_ARGS = ["--clickhouse-dsn", "off", "--log-level", "warning"]


def engine(side: ServeProcess) -> dict[str, Any] | None:
    engines = side.engines()
    return engines[0] if engines else None


def layout_states(side: ServeProcess) -> list[int] | None:
    body = side.get("/api/layout", params={"max_runs": 200_000, "history_points": 0}).json()
    if not body["engines"] or body["engines"][0]["status"] != "ok":
        return None
    runs = np.array(body["engines"][0]["layout"]["runs"], dtype=np.int32).reshape(-1, 4)
    return [int(s) for s in decode_runs(runs)[0]]


def quiet_compare(side: ServeProcess, drv: TwinDriver) -> dict[str, Any]:
    """Pause the twin; once the sidecar has what the probe sent, its ledger must equal the
    real pool: the free / used / evictable counts and the state of every block."""
    want, states = drv.pause()
    rec = drv.recorder
    wait_until("the probe's ring to drain", lambda: not rec.ring, 10)

    last: dict[str, Any] = {}

    def same() -> dict[str, Any] | None:
        e = engine(side) or {}
        last.update({k: e.get(k) for k in ("synced", "steps", "ledger_gaps",
                                             "ledger_mismatches", *want)})
        if e and e["synced"] and all(e.get(k) == v for k, v in want.items()):
            return e
        return None

    try:
        e = wait_until(f"the sidecar's ledger to equal the pool {want}", same, 15)
    except AssertionError as exc:
        senders = [(s.sent, s.is_alive()) for s in plugin._senders]
        raise AssertionError(
            f"{exc}; the sidecar's view: {last}; probe seq {rec.seq} ring_dropped "
            f"{rec.ring_dropped} send_dropped {rec.send_dropped} senders {senders}; sidecar "
            f"received {side.value('kvscope_probe_records_received_total')}, rejected "
            f"{side.value('kvscope_probe_frames_rejected_total', reason='unknown_session')}"
        ) from None
    wait_until("the sidecar's layout to equal the pool block by block",
               lambda: layout_states(side) == states, 15, every_s=0.25)
    assert e["ledger_mismatches"] == 0
    return e


@contextmanager
def twin_streaming(side: ServeProcess, *replacements: ServeProcess) -> Iterator[TwinDriver]:
    """Start ``side`` and the twin stepping every ``STEP_S`` with the probe streaming to it,
    until the sidecar's ledger is synced. On leaving: the twin and the probe stop, then the
    replacements and ``side`` itself."""
    drv: TwinDriver | None = None
    try:
        side.start()
        drv = TwinDriver(side.endpoint, step_s=STEP_S).start()
        wait_until("the engine to be synced", lambda: (e := engine(side)) and e["synced"], 60)
        yield drv
    finally:
        if drv is not None:
            drv.stop()
        plugin.stop_all()
        for s in (*replacements, side):
            s.stop()


def count_keyframes(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic time of every keyframe a Recorder builds from now on."""
    keyframes: list[float] = []
    real_keyframe = Recorder.keyframe

    def counted_keyframe(self: Recorder, t_now: int) -> None:
        keyframes.append(time.monotonic())
        real_keyframe(self, t_now)

    monkeypatch.setattr(Recorder, "keyframe", counted_keyframe)
    return keyframes


@dataclass
class Stop:
    """What happened while the sidecar was frozen."""

    t_stop: float
    t_cont: float
    steps: int
    """Steps the engine took meanwhile."""
    dropped: int
    """Records the probe had dropped by the end of the stop, since it started."""


def freeze(side: ServeProcess, drv: TwinDriver) -> Stop:
    """SIGSTOP the sidecar for ``STOP_S``, and on until the probe has dropped a record (at
    most ``STOP_MAX_S``), then SIGCONT it. The socket queues ``KVSCOPE_PROBE_HWM`` frames
    and the kernel ~400 KB more: an engine slowed by a loaded machine can still fit in them
    after ``STOP_S`` (wire version 4 sends a third fewer bytes a step), and a stall no
    record was dropped for leaves nothing to resynchronise."""
    t_stop = time.monotonic()
    steps_at_stop = drv.steps
    rec = drv.recorder
    side.pause()
    time.sleep(STOP_S)
    while (rec.ring_dropped + rec.send_dropped == 0
           and time.monotonic() - t_stop < STOP_MAX_S):
        time.sleep(0.1)
    steps_in_stop = drv.steps - steps_at_stop
    dropped_in_stop = rec.ring_dropped + rec.send_dropped
    t_cont = time.monotonic()
    side.resume()
    return Stop(t_stop, t_cont, steps_in_stop, dropped_in_stop)


def resynced(side: ServeProcess, t_cont: float) -> tuple[float, float]:
    """The ledger gaps the thawed sidecar saw, and how long after ``t_cont`` it was synced."""
    gaps = wait_until("a gap to be seen after SIGCONT",
                      lambda: side.value("kvscope_ledger_gaps_total", server="", engine="0",
                                         model="twin"), 60)
    wait_until("the ledger to be synced again",
               lambda: side.value("kvscope_ledger_synced", server="", engine="0",
                                  model="twin") == 1,
               30, every_s=0.05)
    return gaps, time.monotonic() - t_cont


def test_a_stopped_sidecar_never_blocks_the_engine(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_PROBE_KEYFRAME_S", "1")
    keyframes = count_keyframes(monkeypatch)
    waits = threads_that_wait(monkeypatch)
    side = ServeProcess(tmp_path / "side", args=SERVE_ARGS)
    with twin_streaming(side) as drv:
        time.sleep(5.0)
        stop = freeze(side, drv)
        gaps, resync_s = resynced(side, stop.t_cont)
        time.sleep(2.0)
        e = quiet_compare(side, drv)
        rec = drv.recorder
        produced = rec.seq
        dropped = rec.ring_dropped + rec.send_dropped
        received = wait_until(
            "records received + dropped to reach records produced",
            lambda: (n := side.value("kvscope_probe_records_received_total")) is not None
            and n + dropped >= produced and n, 30)
        assert not drv.errors, drv.errors
        kf_during = sum(stop.t_stop <= t < stop.t_cont for t in keyframes)
        before = drv.step_ns(stop.t_stop - 5.0, stop.t_stop)
        during = drv.step_ns(stop.t_stop, stop.t_cont)
        p99_before, p99_during = percentile(before, 0.99), percentile(during, 0.99)
        print(f"\nproperty 2: {len(before)} steps before, {stop.steps} steps during the "
              f"{stop.t_cont - stop.t_stop:.0f} s SIGSTOP "
              f"({(stop.t_cont - stop.t_stop) / STEP_S:.0f} due); schedule() p50/p99/max "
              f"before {percentile(before, 0.5) / 1e3:.0f}/{p99_before / 1e3:.0f}/"
              f"{max(before) / 1e3:.0f} us, during {percentile(during, 0.5) / 1e3:.0f}/"
              f"{p99_during / 1e3:.0f}/{max(during) / 1e3:.0f} us; records produced "
              f"{produced}, received {received:.0f}, dropped {dropped} (ring "
              f"{rec.ring_dropped}, send {rec.send_dropped}; {stop.dropped} by the end of "
              f"the stop), {kf_during} keyframes during the stop, gaps {gaps:.0f}, "
              f"resynced {resync_s:.1f} s after SIGCONT, "
              f"free blocks {e['free_blocks']} == pool")
        # the engine kept its pace and schedule() its cost while the sidecar was frozen
        # (its pace against its own pace just before, in the same run: an absolute
        # quarter of the 2 ms pace failed at 2212 of 3750 steps on a loaded 2-core box)
        stopped_s = stop.t_cont - stop.t_stop
        assert stop.steps / stopped_s >= 0.5 * len(before) / 5.0, (stop.steps, len(before))
        # nothing that can wait on the sidecar ran on the engine thread (its cost is
        # benchmarks/' business, not a timed assertion here)
        assert set(waits) >= {"push_socket", "send"}, waits
        assert all(drv.thread.name not in threads for threads in waits.values()), waits
        assert stop.dropped > 0  # the stall was felt, and paid for in counted drops
        # a failed send asks for a keyframe, but not one per step for the whole outage
        assert kf_during <= stopped_s * (1 + 1 / FORCED_KEYFRAME_GAP_S) + 5
        # every record is accounted for: received by the sidecar, or dropped and counted
        assert received + dropped == produced


@contextmanager
def watched(side: ServeProcess) -> Iterator[list[tuple[float, bool, bool]]]:
    """Scrape ``side`` every 20 ms on a thread, from its first answer on, until the block
    ends: (time, ledger synced, a free-blocks figure shown) for each scrape."""
    seen: list[tuple[float, bool, bool]] = []
    watching = threading.Event()

    def watch() -> None:
        while watching.is_set():
            try:
                m = side.metrics()
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.02)
                continue
            synced = m.get(("kvscope_ledger_synced", frozenset(
                {"server": "", "engine": "0", "model": "twin"}.items())))
            has_free = any(k[0] == "vllm_scheduler_free_blocks" for k in m)
            seen.append((time.monotonic(), synced == 1, has_free))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watching.set()
    watcher.start()
    try:
        yield seen
    finally:
        watching.clear()
        watcher.join(5)


def test_a_killed_sidecar_is_replaced_and_the_new_one_resyncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSCOPE_PROBE_KEYFRAME_S", "3")
    first = ServeProcess(tmp_path / "first", args=SERVE_ARGS)
    second = ServeProcess(tmp_path / "second", endpoint=first.endpoint, args=SERVE_ARGS)
    with twin_streaming(first, second) as drv:
        quiet_compare(first, drv)
        drv.resume()
        time.sleep(1.0)
        first.kill()
        steps_at_kill, t_kill = drv.steps, time.monotonic()
        time.sleep(2.0)
        assert drv.steps - steps_at_kill > 0.25 * 2.0 / STEP_S  # the engine did not wait
        with watched(second) as seen:
            second.start()
            t_up = time.monotonic()
            wait_until("the new sidecar to hear the probe (it reconnects by itself)",
                       lambda: engine(second) is not None, 30)
            wait_until("the new sidecar's ledger to be synced",
                       lambda: (e := engine(second)) and e["synced"], 30)
            synced_after = time.monotonic() - t_up
            time.sleep(1.0)
        e = quiet_compare(second, drv)
        rejected = second.value("kvscope_probe_frames_rejected_total", reason="unknown_session")
        assert not drv.errors, drv.errors
        rec = drv.recorder
        print(f"\nproperty 3: sidecar killed at step {steps_at_kill}; the twin took "
              f"{drv.steps - steps_at_kill} more steps; the new sidecar synced "
              f"{synced_after:.1f} s after it answered ({time.monotonic() - t_kill:.1f} s "
              f"after the kill), {len(seen)} scrapes watched, frames refused before the "
              f"keyframe (unknown session) {rejected:.0f}; probe dropped "
              f"{rec.ring_dropped + rec.send_dropped} records, counted; free blocks "
              f"{e['free_blocks']} == pool, ledger gaps {e['ledger_gaps']}")
        # before its first keyframe the new sidecar shows no block figure at all, never
        # a guess; after it, every scrape shows the ledger synced
        assert seen and all(has_free == synced for _, synced, has_free in seen)
        first_synced = next(i for i, s in enumerate(seen) if s[1])
        assert all(s[1] for s in seen[first_synced:])
