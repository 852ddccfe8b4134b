"""Bounded recovery: after a contained fault, and through a long sidecar outage, no step
of vLLM's engine thread reads more than a fixed budget of pool blocks, and the sidecar
ends exactly in sync.

vLLM's real Scheduler runs in-process (``kvscope.twin``) with the probe's hooks. The
blocks the engine thread reads are counted in the probe's pool scan itself
(``PoolMirror._scan_range``, and the whole-pool ``_scan_states``), per ``schedule()``.
The outage drops every send on the sender's own path (``transport.send`` answers that
nothing went), and the clock the hooks read advances a fixed amount per call, so the
outage lasts 60 s of probe time whatever the machine's speed.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvscope.state.hub import Hub
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import hooks, plugin, sender, transport, wire
from kvscope_probe.mirror import REPAIR_BLOCKS, PoolMirror
from kvscope_probe.recorder import Recorder
from kvscope_probe.sender import take_batch
from tests.twin.exactness import pool_truth

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin

NUM_BLOCKS = 4 * REPAIR_BLOCKS + 100  # a repair needs five slices


def count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """``{"n": pool blocks the Recorder's scans read}`` from now on."""
    reads = {"n": 0, "nested": 0}
    full, part = PoolMirror._scan_states, PoolMirror._scan_range

    def scan_states(self: PoolMirror) -> bytearray:
        reads["n"] += len(self.pool.blocks)
        reads["nested"] += 1  # a whole scan made of ranges is counted once
        try:
            return full(self)
        finally:
            reads["nested"] -= 1

    def scan_range(self: PoolMirror, states: bytearray, lo: int, hi: int) -> int:
        if not reads["nested"]:
            reads["n"] += len(self.pool.blocks[lo:hi])
        return part(self, states, lo, hi)

    monkeypatch.setattr(PoolMirror, "_scan_states", scan_states)
    monkeypatch.setattr(PoolMirror, "_scan_range", scan_range)
    return reads


def exact(hub: Hub, rec: Recorder, pool: Any) -> bool:
    """The ledger is in sync, and equals vLLM's pool block for block."""
    led = hub.engines[rec.hello.engine].ledger
    if not led.synced:
        return False
    free, cached = pool_truth(pool)
    arr = led.array()
    assert {i for i in range(led.num_blocks) if arr[i] <= wire.STATE_CACHED} == free
    assert {i for i in range(led.num_blocks) if arr[i] == wire.STATE_CACHED} == cached
    assert led.free == len(free) == pool.get_num_free_blocks()
    return True


def probed(monkeypatch: pytest.MonkeyPatch, keyframe_s: float) -> tuple[Any, Recorder, Any]:
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=NUM_BLOCKS), seed=3)
    sched = twin.scheduler
    rec = Recorder(sched, ring_size=1 << 20, keyframe_interval_s=keyframe_s)
    plugin.bind(sched, rec)
    rec.push(rec.hello)
    rec.keyframe(hooks._now_ns())
    return twin, rec, sched.kv_cache_manager.block_pool


def test_a_fault_is_repaired_in_bounded_slices_and_the_ledger_ends_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    twin, rec, pool = probed(monkeypatch, keyframe_s=3600)
    reads = count_reads(monkeypatch)
    hub = Hub()
    sched = twin.scheduler
    per_step: list[int] = []
    trail: list[tuple[bool, bool]] = []  # (repair under way, ledger exact) per step
    frees = {"n": 0}
    real_free = PoolMirror.on_free

    def on_free(self: PoolMirror, blocks: Any) -> None:
        frees["n"] += 1
        if frees["n"] == 40:  # the mirror misses this free: it is wrong from here
            raise RuntimeError("injected in on_free")
        real_free(self, blocks)

    monkeypatch.setattr(PoolMirror, "on_free", on_free)

    def checked_schedule(*args: Any, **kwargs: Any) -> Any:
        reads["n"] = 0
        out = type(sched).schedule(sched, *args, **kwargs)
        per_step.append(reads["n"])
        while rec.ring:
            assert hub.accept(wire.encode(take_batch(rec)))
        trail.append((rec.dirty, exact(hub, rec, pool)))
        return out

    sched.schedule = checked_schedule
    result = twin.run(generate(WorkloadSpec(n_requests=200, seed=1)))
    assert result.finished == 200
    assert rec.faults == 1 and frees["n"] > 40
    # no step read more than the budget, and the repair took several steps
    assert max(per_step) <= REPAIR_BLOCKS, max(per_step)
    assert sum(per_step) == len(pool.blocks)  # one pass over the pool, in slices
    assert sum(n > 0 for n in per_step) == -(-len(pool.blocks) // REPAIR_BLOCKS)
    # while the repair was under way the ledger read stale; it ended exact and stayed so
    repairing = [i for i, (d, _) in enumerate(trail) if d]
    assert repairing and not any(trail[i][1] for i in repairing)
    after = repairing[-1] + 1
    assert all(ok for _, ok in trail[after:]) and len(trail) > after


def test_a_60_s_outage_forces_no_keyframes_and_the_sidecar_resyncs_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"ns": 10**12}

    def now() -> int:  # 25 ms per call, two calls a step: 50 ms a step
        clock["ns"] += 25_000_000
        return clock["ns"]

    monkeypatch.setattr(hooks, "_now_ns", now)
    twin, rec, pool = probed(monkeypatch, keyframe_s=5.0)
    reads = count_reads(monkeypatch)
    hub = Hub()
    sched = twin.scheduler
    snd = sender.Sender(rec, "inproc://unused")  # never started: drained after each step
    snd._sock = object()
    away = {"on": False}

    def send(_sock: Any, parts: list[bytes], _wait_ms: int) -> bool:
        if away["on"]:
            return False  # the sidecar is gone: nothing goes, the batch is dropped
        assert hub.accept(parts)
        return True

    monkeypatch.setattr(transport, "send", send)
    keyframes: list[int] = []
    real_keyframe = Recorder.keyframe

    def keyframe(self: Recorder, t_now: int) -> None:
        before = self.seq
        real_keyframe(self, t_now)
        if self.seq > before:
            keyframes.append(t_now)

    monkeypatch.setattr(Recorder, "keyframe", keyframe)
    outage_ns = 60 * 10**9
    window: dict[str, int] = {}
    steps = {"n": 0, "max_reads": 0, "exact_after": 0, "after": 0}

    def checked_schedule(*args: Any, **kwargs: Any) -> Any:
        reads["n"] = 0
        out = type(sched).schedule(sched, *args, **kwargs)
        steps["n"] += 1
        steps["max_reads"] = max(steps["max_reads"], reads["n"])
        if steps["n"] == 50:
            away["on"], window["start"] = True, clock["ns"]
        elif away["on"] and clock["ns"] - window["start"] >= outage_ns:
            away["on"], window["end"] = False, clock["ns"]
        snd.drain_once()
        if "end" in window:
            steps["after"] += 1
            steps["exact_after"] += exact(hub, rec, pool)
        return out

    sched.schedule = checked_schedule
    n_requests = 700  # enough steps for the outage and a while after it
    result = twin.run(generate(WorkloadSpec(n_requests=n_requests, seed=1)))
    assert result.finished == n_requests
    assert "end" in window, steps
    snd.drain_once()
    assert rec.send_dropped > 0 and rec.faults == 0
    # a drop never makes the engine thread repair from the pool (the audit's fixed slice
    # a step, mirror.audit_blocks, is not a repair: test_probe_audit.py)
    assert steps["max_reads"] == 0
    during = [t for t in keyframes if window["start"] <= t < window["end"]]
    # only the periodic keyframe while the sidecar is away: one per 5 s period
    assert len(during) <= outage_ns // (5 * 10**9) + 1, len(during)
    # resynced at the first send after the outage, and exact on every step from there
    # but the few before the keyframe the first successful send asked for went out
    assert steps["after"] - steps["exact_after"] <= 3, steps
    assert exact(hub, rec, pool)
    assert hub.engines[rec.hello.engine].counters.ledger_mismatches == 0


def test_no_keyframe_is_built_while_the_ring_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyframe pushed into a full ring is dropped at once (and asks for another): it
    waits for room instead, so a stalled sender costs no keyframe builds."""
    twin, rec, _pool = probed(monkeypatch, keyframe_s=3600)
    rec.ring_size = len(rec.ring)  # full: the hello and the first keyframe
    built = {"n": 0}
    real_settle = Recorder.settle

    def settle(self: Recorder) -> None:
        built["n"] += 1
        real_settle(self)

    dropped = rec.ring_dropped
    rec.want_keyframe = True
    monkeypatch.setattr(Recorder, "settle", settle)
    for t in range(5):
        rec.keyframe(hooks._now_ns() + t * 10**9)
    assert built["n"] == 0 and rec.ring_dropped == dropped and rec.want_keyframe
    seq, data = rec.ring.popleft()  # the sender takes one
    rec.popped_bytes += len(data)
    rec.keyframe(hooks._now_ns())
    assert built["n"] == 1 and not rec.want_keyframe
    assert isinstance(msgspec.msgpack.decode(rec.ring[-1][1], type=wire.Record), wire.Keyframe)


def test_forced_keyframes_take_at_most_their_share_of_the_engine_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyframe reads every holder's table on vLLM's engine thread (milliseconds on a
    large pool), and a sidecar that reads, stalls and reads again asks for one after each
    resync. After a keyframe that took T, the next forced one waits T / 1% (0.2 s at
    least): a 5 ms keyframe, 0.5 s; the gap stayed 0.2 s whatever T, five a second."""
    from kvscope_probe import recorder

    # a 5 ms keyframe, then a cheap one (0.1 ms): the 0.2 s floor holds
    (first, _), (cheap, _) = keyframes_taking(monkeypatch, 3600, 5_000_000, 100_000)
    assert first == 5_000_000 / recorder.FORCED_KEYFRAME_SHARE == 5 * 10**8
    assert cheap == int(recorder.FORCED_KEYFRAME_GAP_S * 1e9)


def keyframes_taking(monkeypatch: pytest.MonkeyPatch, keyframe_s: float,
                     *took_ns: int) -> list[tuple[int, int]]:
    """A keyframe taking each of ``took_ns`` (a clock that moves that much between its
    start and its end), built at one time t: (next forced - t, next periodic - t) after
    each."""
    from kvscope_probe import recorder

    _twin, rec, _pool = probed(monkeypatch, keyframe_s=keyframe_s)
    clock = {"ns": 10**12, "step": 0}

    def now() -> int:
        clock["ns"] += clock["step"]
        return clock["ns"]

    monkeypatch.setattr(recorder, "_now_ns", now)
    t = 7 * 10**12
    out = []
    for took in took_ns:
        clock["step"] = took
        rec.keyframe(t)
        out.append((rec.next_forced_ns - t, rec.next_keyframe_ns - t))
    return out


def test_periodic_keyframes_take_at_most_their_share_of_the_engine_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The periodic keyframe came every KVSCOPE_PROBE_KEYFRAME_S whatever it took; it
    reads every holder's table (blocks held plus shared prefixes: tens of milliseconds
    on a pool of half a million), so the share of the engine thread it took grew with the
    pool. After one that took T the next periodic one waits T / 1% at least."""
    from kvscope_probe import recorder

    # an 80 ms keyframe, then a 2 ms one: the interval holds
    (_, slow), (_, quick) = keyframes_taking(monkeypatch, 5, 80_000_000, 2_000_000)
    assert slow == 80_000_000 / recorder.FORCED_KEYFRAME_SHARE == 8 * 10**9
    assert quick == 5 * 10**9
