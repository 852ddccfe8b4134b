"""The audit: vLLM's own pool compared with the sidecar's ledger, slice by slice.

The probe reads ``audit_blocks`` blocks of vLLM's ``BlockPool.blocks`` and one running
request's table after one step in ``AUDIT_EVERY`` (``PoolMirror.audit``); the sidecar
compares them with its ledger (``kvscope.state.audit``). The ledger is fed by the probe's
ops and keyframes, so the older self-checks (the free count, a keyframe against the
replayed ops) compare the probe with itself; the audit compares it with vLLM. Every
block is read once in ``ceil(num_blocks / audit_blocks) * AUDIT_EVERY`` steps: a drift
that lasts is counted within that many steps.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import mirror, wire
from tests.twin.exactness import truth_states

pytestmark = pytest.mark.twin

ProbedTwin = pytest.importorskip("kvscope.twin.probed").ProbedTwin

SPEC = WorkloadSpec(n_requests=120, seed=3)


class Watch:
    """At the end of every ``schedule()`` (where the probe records): drained into the
    hub, the ledger compared with a full scan of vLLM's pool (the test's own truth,
    independent of the audit), the audit's counts noted."""

    def __init__(self, probed: Any, at_step: Any = None) -> None:
        self.probed = probed
        self.pool = probed.scheduler.kv_cache_manager.block_pool
        self.at_step = at_step
        self.steps = 0
        self.first_wrong: int | None = None  # first step the ledger differed from vLLM
        self.first_counted: int | None = None  # first step the audit counted a mismatch
        self.must_count: int | None = None
        """First step by which some block had been wrong in the ledger at the end of
        ``pass_steps`` steps in a row: the slices of those steps covered it, so the
        audit must have counted by then. (A block vLLM rewrites sooner may go unseen:
        it is right again.)"""
        self._wrong_for: dict[int, int] = {}
        self.corrupted_at: int | None = None
        self.expected_blocks = 0
        self.expected_tables = 0
        self._lo = 0
        self._wait = 0
        sched = probed.scheduler
        original = type(sched).schedule  # the probe's hooked method

        def checked_schedule(*args: Any, **kwargs: Any) -> Any:
            synced_before = probed.state.ledger.synced if self.steps else False
            out = original(sched, *args, **kwargs)
            self.after_step(synced_before)
            return out

        sched.schedule = checked_schedule

    def after_step(self, synced_before: bool) -> None:
        self.steps += 1
        probed = self.probed
        probed.drain()
        st = probed.state
        # The slice this step's record carried, as the probe walks the pool: compared
        # only with a ledger in sync when the record arrived.
        n, k = len(self.pool.blocks), probed.rec.audit_blocks
        if self._wait:  # one step in AUDIT_EVERY carries an audit, the first included
            self._wait -= 1
        else:
            self._wait = mirror.AUDIT_EVERY - 1
            if synced_before:
                self.expected_blocks += min(n, self._lo + k) - self._lo
                self.expected_tables += bool(probed.scheduler.running)
            self._lo = 0 if self._lo + k >= n else self._lo + k
        if self.at_step is not None:
            self.at_step(self)
        led = st.ledger
        truth = truth_states(self.pool)
        wrong = ({i for i, (a, b) in enumerate(zip(led.states, truth, strict=True)) if a != b}
                 if led.synced else set())
        if wrong and self.first_wrong is None:
            self.first_wrong = self.steps
        self._wrong_for = {i: self._wrong_for.get(i, 0) + 1 for i in wrong}
        if self.must_count is None and any(
                n >= pass_steps(probed) for n in self._wrong_for.values()):
            self.must_count = self.steps
        if self.first_counted is None and any(st.audit.mismatches.values()):
            self.first_counted = self.steps


def run(watch_at: Any = None, *, num_blocks: int = 160, keyframe_s: float = 3600.0
        ) -> tuple[Any, Watch]:
    probed = ProbedTwin(TwinConfig(num_blocks=num_blocks), seed=3,
                        keyframe_interval_s=keyframe_s)
    watch = Watch(probed, watch_at)
    result = probed.run(generate(SPEC))
    assert result.finished == SPEC.n_requests
    return probed, watch


def pass_steps(probed: Any) -> int:
    return -(-len(probed.rec.states) // probed.rec.audit_blocks) * mirror.AUDIT_EVERY


def test_a_healthy_run_audits_every_block_and_finds_nothing() -> None:
    """Every step's slice and table are compared (exactly the ones a synced ledger
    received), the pool is covered many times over, and nothing differs: 0 exactly."""
    probed, watch = run()
    audit = probed.state.audit
    assert probed.rec.audit_blocks == mirror.AUDIT_MIN_BLOCKS  # 160 blocks: the floor
    assert watch.first_wrong is None
    assert audit.mismatches == {"block_state": 0, "request_table": 0, "probe_mirror": 0}
    assert audit.blocks == watch.expected_blocks > 0
    assert audit.tables == watch.expected_tables > 0
    # whole passes: one per pass_steps synced steps, the first partial one aside
    assert audit.passes >= watch.steps // pass_steps(probed) - 2 > 10
    assert audit.pass_seconds is not None and audit.pass_seconds > 0


def test_the_slice_is_bounded_and_a_pass_takes_the_stated_steps() -> None:
    """The budget of one audit: at least AUDIT_MIN_BLOCKS, one step in AUDIT_EVERY, and
    the whole pool in at most AUDIT_PASS_STEPS steps at any size (128k blocks: 256
    every 8th step)."""
    per_audit = mirror.AUDIT_PASS_STEPS // mirror.AUDIT_EVERY
    for n, want in ((48, 64), (32768, 64), (32769, 65), (131072, 256), (1 << 20, 2048)):
        blocks = max(mirror.AUDIT_MIN_BLOCKS, -(-n // per_audit))
        assert blocks == want
        assert -(-n // blocks) * mirror.AUDIT_EVERY <= mirror.AUDIT_PASS_STEPS
    probed = ProbedTwin(TwinConfig(num_blocks=1000), seed=1)
    rec = probed.rec
    assert rec.audit_blocks == 64
    due = [rec.audit_due() for _ in range(3 * mirror.AUDIT_EVERY)]
    assert [i for i, d in enumerate(due) if d] == [0, mirror.AUDIT_EVERY, 2 * mirror.AUDIT_EVERY]
    a = rec.audit(probed.scheduler.running, probed.scheduler.kv_cache_manager.get_block_ids)
    assert (a.lo, len(a.states), a.mirror_fixed, a.req_id) == (0, 64, 0, "")
    assert a.states == truth_states(rec.pool)[:64]


def test_a_corrupted_mirror_is_counted_within_one_pass_and_repaired() -> None:
    """Free blocks of the probe's mirror marked cached and cached ones free mid-run, and
    a keyframe of it sent: the ledger now differs from vLLM where the ops never said so,
    and the free count (the older self-check) cannot see it. The audit counts it within
    one pass, the probe sets its mirror right, and a keyframe repairs the ledger: at the
    end both equal vLLM's pool exactly."""
    corrupted: list[int] = []

    def corrupt(w: Watch) -> None:
        rec = w.probed.rec
        if corrupted or w.steps < 40:
            return
        free = [i for i, s in enumerate(rec.states) if s == wire.STATE_FREE][:6]
        cached = [i for i, s in enumerate(rec.states) if s == wire.STATE_CACHED][:6]
        if not (free and cached):
            return  # the premise: some of each; a later step then
        for i in free:
            rec.states[i] = wire.STATE_CACHED
        for i in cached:
            rec.states[i] = wire.STATE_FREE
        corrupted.extend(free + cached)
        w.corrupted_at = w.steps
        rec.keyframe(time.perf_counter_ns())
        w.probed.drain()

    probed, watch = run(corrupt)
    audit = probed.state.audit
    assert corrupted and watch.first_wrong == watch.corrupted_at
    assert probed.state.counters.ledger_mismatches == 1  # the keyframe against the ops
    assert watch.first_counted is not None
    assert watch.must_count is None or watch.first_counted <= watch.must_count
    assert watch.first_counted - watch.first_wrong <= pass_steps(probed)
    assert 0 < audit.mismatches["probe_mirror"] <= len(corrupted)
    assert audit.mismatches["block_state"] > 0
    assert bytes(probed.rec.states) == truth_states(probed.rec.pool)
    led = probed.state.ledger
    if not led.synced:  # the run ended within the forced keyframes' least gap (0.2 s)
        assert probed.rec.want_keyframe  # ... but the probe asked for one
        probed.rec.keyframe(time.perf_counter_ns())
        probed.drain()
    assert led.synced and bytes(led.states) == truth_states(probed.rec.pool)


class MovedHash:
    """A doctored vLLM block: the prefix-cache hash moved elsewhere behind the same
    ``block_hash`` property, ``_block_hash`` left None. The probe's fingerprint ran at
    attach on the real class; its fast path reads ``_block_hash`` and so sees every
    freed block as uncached, while vLLM keeps them cached and evictable. (vLLM's block
    has slots: the subclass adds none, and the hashes live in a dict by block.)"""

    @staticmethod
    def doctor(pool: Any) -> None:
        base = type(pool.blocks[0])
        moved: dict[int, Any] = {}

        def get(self: Any) -> Any:
            return moved.get(id(self))

        def set_block_hash(self: Any, block_hash: Any, num_tokens: Any = None) -> None:
            moved[id(self)] = block_hash
            self._block_hash_num_tokens = num_tokens

        def reset_hash(self: Any) -> None:
            moved.pop(id(self), None)
            self._block_hash_num_tokens = None

        cls = type("KVCacheBlock", (base,), {
            "__slots__": (), "block_hash": property(get),
            "set_block_hash": set_block_hash, "reset_hash": reset_hash})
        for b in pool.blocks:
            if b._block_hash is not None:
                moved[id(b)] = b._block_hash
            b._block_hash = None
            b.__class__ = cls


def test_a_vllm_change_the_probe_cannot_see_is_counted_by_the_audit_alone() -> None:
    """The ops and the mirror agree with each other and the free count is right, so
    the older self-checks stay at 0; only the audit, reading vLLM's own blocks, sees the
    cached blocks the ledger calls plain free, within one pass of the first."""
    def doctor(w: Watch) -> None:
        if w.steps == 1:
            assert w.probed.rec.sort_freed.__name__ == "_sort_freed_by_field"
            MovedHash.doctor(w.probed.rec.pool)

    probed, watch = run(doctor)
    st = probed.state
    assert st.counters.ledger_mismatches == 0  # the probe checked against itself: blind
    assert watch.first_wrong is not None
    assert watch.first_counted is not None
    assert watch.must_count is None or watch.first_counted <= watch.must_count
    assert st.audit.mismatches["block_state"] > 0
    assert st.audit.mismatches["probe_mirror"] > 0


def test_a_request_table_that_differs_from_vllm_is_counted() -> None:
    """Every running request's table changed in the ledger behind the ops' back (the
    block states left right): the next audit's table differs, counted once, and
    the ledger is stale from then on (no keyframe is due for an hour)."""
    def tamper(w: Watch) -> None:
        led = w.probed.state.ledger
        if w.steps == 30:
            assert w.probed.scheduler.running
            for rid, table in led.tables.items():
                led.tables[rid] = [[*g, 1] for g in table]

    probed, watch = run(tamper)
    audit = probed.state.audit
    # the first step after the tampering that carries an audit (one in AUDIT_EVERY)
    assert watch.first_counted == next(
        s for s in range(31, 31 + mirror.AUDIT_EVERY) if (s - 1) % mirror.AUDIT_EVERY == 0)
    assert audit.mismatches == {"block_state": 0, "request_table": 1, "probe_mirror": 0}
    assert not probed.state.ledger.synced


def test_a_vllm_whose_null_block_is_not_block_0_is_not_recorded(
        caplog: pytest.LogCaptureFixture) -> None:
    """The ledger and the audit take block 0 for vLLM's null block (as 0.32 and 0.33
    make it): a vLLM that picks another is left alone, with one log line, not recorded
    on a guess."""
    from kvscope.twin.engine import Twin
    from kvscope_probe import plugin

    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=48), seed=1)
    pool = twin.scheduler.kv_cache_manager.block_pool
    assert pool.null_block.block_id == 0  # the premise, on this vLLM
    twin.scheduler._kvscope = None
    pool.null_block = pool.blocks[5]
    plugin._endpoint = "ipc:///nonexistent/kvscope-test.sock"
    try:
        with caplog.at_level("WARNING", logger="kvscope_probe"):
            assert plugin.attach(twin.scheduler) is None
    finally:
        plugin.enable(None)
    assert "null block is block 5, not 0" in caplog.text
    assert not twin.scheduler._kvscope.enabled  # marked: not retried every step


def test_the_audit_reads_each_block_state_as_vllm_holds_it() -> None:
    """``PoolMirror._read`` (what the audit and the repair read) equals the test's own
    scan of vLLM's pool at every step, for the whole pool and for a slice not starting
    at block 0 (the null block is block 0 only); the run holds every state."""
    seen: set[int] = set()
    checked = []

    def at_step(watch: Watch) -> None:
        rec, truth = watch.probed.rec, truth_states(watch.pool)
        n = len(truth)
        assert bytes(rec._read(0, n)) == truth
        assert bytes(rec._read(37, n - 5)) == truth[37:n - 5]
        assert bytes(rec._read(5, 5)) == b""
        seen.update(truth)
        checked.append(watch.steps)

    run(at_step)
    assert len(checked) > 100
    assert seen == {wire.STATE_FREE, wire.STATE_CACHED, wire.STATE_USED, wire.STATE_NULL}
