"""Per-scheduler state of the probe, touched only by vLLM's engine thread.

At the end of every ``schedule()`` the engine thread encodes what the step changed as
one columnar ``wire.Step`` (msgpack straight from vLLM's lists and dicts, no struct per
request, no copy of them first) and appends the bytes to a ring bounded in entries and
exact bytes. It keeps no reference to vLLM's ``SchedulerOutput``: on one GPU the model
runner lives in this process and extends that output's block lists in place after
``schedule()`` returns. Encoding here rather than on the sender thread costs the engine
thread about what copying did, and nothing the ring holds is a container for the garbage
collector to scan and promote (a ring of copied lists made the collector run five times
as often). It never sends or blocks; the sender thread (``sender.py``) does.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from itertools import compress
from typing import Any

import msgspec

from kvscope_probe import fingerprint, wire
from kvscope_probe.calibrate import layer_costs
from kvscope_probe.identity import hello
from kvscope_probe.mirror import PoolMirror, _sort_freed
from kvscope_probe.needhook import arm, arm_below
from kvscope_probe.reasons import classify

log = logging.getLogger("kvscope_probe")

_now_ns = time.perf_counter_ns
_wall = time.time

MAX_FAULTS = 1000  # contained exceptions before the probe switches itself off
FORCED_KEYFRAME_GAP_S = 0.2
"""Least time between keyframes asked for by a drop or a fault. A dropped send asks for
one only once a later send goes through (``sender.py``), so while the sidecar is gone only
the periodic keyframe is built."""
FORCED_KEYFRAME_SHARE = 0.01
"""And at most this share of the engine thread's time: after a keyframe that took T (a
large pool's tables: milliseconds), the next one, forced or periodic, waits T / this, so
neither a sidecar that reads, stalls and reads again nor a pool of a million blocks can
make keyframes take more (benchmarks/README.md: 1.8-3.5 ms with 130,561 blocks held by
256 requests)."""
KEYFRAME_SLICE_BLOCKS = 8192
"""Block-table entries a keyframe reads from vLLM in one step, at most (plus one request's
table): the rest follow in ``wire.KeyframeTables`` records, one a step. Reading a table goes
through vLLM's ``get_block_ids``, ~12-25 ns an entry warm and several times that cold
(``benchmarks/keyframe_cost.py``): whole, a keyframe of 523,777 blocks held paused the
engine thread 19-100 ms; a slice is well under a millisecond."""


RING_BYTES = 64 << 20
"""Default bound of the ring in encoded bytes, beside its bound in entries."""
_encode = msgspec.msgpack.Encoder().encode
_NO_IDS: dict[str, int] = {}
_NO_COUNTS: list[int] = []  # shared empties, never modified
_NO_IDS_LIST: list[str] = []
_NO_NEW: list[wire.NewReq] = []


class Recorder(PoolMirror):
    """Records one Scheduler and its BlockPool; created on the first hook call."""

    def __init__(self, sched: Any, *, ring_size: int, keyframe_interval_s: float,
                 ring_bytes: int = RING_BYTES) -> None:
        mgr = sched.kv_cache_manager
        self.sched = sched
        self.mgr = mgr
        super().__init__(mgr.block_pool)
        from kvscope_probe.hooks import DISABLED

        self.disabled: dict[str, str] = {**DISABLED, **fingerprint.instance(sched)}
        """{feature: why} not recorded for this scheduler (``fingerprint``)."""
        if "core" in self.disabled:
            raise RuntimeError(self.disabled["core"])
        if "hash_field" in self.disabled:
            self.sort_freed = _sort_freed
        self.enabled = True
        self.stop: Any = None
        """The sender's stop event (``plugin.attach``): set when vLLM shuts this
        scheduler down."""
        self.ring: deque[tuple[int, bytes]] = deque()
        """(sequence number, the record encoded)."""
        self.ring_size = ring_size
        self.ring_bytes = ring_bytes
        self.pushed_bytes = 0  # written by the engine thread only
        self.popped_bytes = 0  # written by the sender thread only
        self.seq = 0
        self.prev_cached: list[str] | None = None
        """``cached_ids`` of the last step record pushed, when the next may refer to it
        (``Step.cached_same``, ``Step.cached_removed``); None after a keyframe, a dropped
        record or a fault."""
        self.ring_dropped = 0
        self.send_dropped = 0  # written by the sender thread only
        self.faults = 0
        self.want_keyframe = True
        self.resync_pending = False
        """A send was dropped: the next send that goes through asks for a keyframe."""
        self.keyframe_interval_ns = int(keyframe_interval_s * 1e9)
        self.next_keyframe_ns = 0
        self.next_forced_ns = 0
        self.kf_rest: list[str] | None = None
        """Requests whose tables the keyframe under way has still to send (``keyframe``);
        None when no keyframe is under way."""
        self.kf_ns = 0  # engine-thread time of the keyframe under way, its slices so far
        self.wrap_ns = 0  # engine-thread time in the wrappers since the last step
        self.arrivals: list[wire.Arrival] = []
        self.ends: list[wire.End] = []
        self.preemptions: list[wire.Preemption] = []
        self.need: tuple[str, int] | None = None  # last (request_id, blocks to allocate)
        self.need_armed = False
        self.need_fn: Any = None  # the hook, built at the first arming
        self.alloc_ns, self.need_ns = layer_costs(
            type(mgr.coordinator).get_num_blocks_to_allocate)
        self.in_schedule = False
        self.last_probe_ns = 0
        self.hello = hello(sched, self.disabled)
        self.group_block_sizes = [g.block_size for g in self.hello.kv_groups]
        self.kv_holding = (None if "kv_holding" in self.disabled
                           else getattr(sched, "kv_holding_waiting", None))
        deferred = getattr(sched, "deferred_waiting", None)
        self.deferred: Any = deferred if isinstance(deferred, set) else frozenset()
        """vLLM's set of waiting requests its loop skipped for other reasons than blocks
        (the one set object it keeps, added to and discarded from: read, never changed)."""
        self.head_extra = int(getattr(sched, "num_lookahead_tokens", 0) or 0)
        """Tokens vLLM allocates for beyond a request's own when it admits one (its
        speculative lookahead: ``allocate_slots``' ``num_lookahead_tokens``)."""
        self.head_cap = self.hello.max_model_len or (1 << 62)
        self.spec_prev: list[str] = []
        self.policy = self.hello.policy
        self.arm_below = -1 if "need" in self.disabled else arm_below(sched, self.hello)

    # -- ring -------------------------------------------------------------------
    def push(self, item: wire.Record) -> None:
        """Encode one record and append it, or drop it (counted) when the ring is full
        in entries or bytes."""
        data = _encode(item)
        seq = self.seq
        self.seq = seq + 1
        if (len(self.ring) >= self.ring_size
                or self.pushed_bytes - self.popped_bytes + len(data) > self.ring_bytes):
            self.ring_dropped += 1
            self.want_keyframe = True
            self.prev_cached = None
            self.kf_rest = None  # the sidecar missed a record: the keyframe is no use now
            return
        self.pushed_bytes += len(data)
        self.ring.append((seq, data))

    def ring_full(self) -> bool:
        return (len(self.ring) >= self.ring_size
                or self.pushed_bytes - self.popped_bytes >= self.ring_bytes)

    def watch_need(self, free_blocks: int) -> None:
        """Watch ``KVCacheCoordinator.get_num_blocks_to_allocate`` on this coordinator only
        while an allocation could fail (``free_blocks <= arm_below``).

        It runs for every scheduled request on every step, so it is wrapped on the instance
        (an attribute that shadows the class method) and only while the pool is low;
        otherwise vLLM calls its own method at full speed.
        """
        on = self.enabled and free_blocks <= self.arm_below  # switched off: never re-armed
        if on == self.need_armed:
            return
        arm(self, on)

    def fault(self, where: str, exc: BaseException, *, rescan: bool = True) -> None:
        """Count a contained error; ``rescan``: the mirror may be wrong (an engine-thread
        hook failed), so it is repaired in slices over the next steps (``repair_slice``)
        and the keyframe waits for the repair. The sender's errors leave the mirror
        intact and must not cost the engine thread a repair."""
        self.faults += 1
        self.want_keyframe = True
        self.prev_cached = None
        self.kf_rest = None
        if rescan:
            self.mark_dirty()
        if self.faults == 1:
            log.warning("kvscope probe: contained an error in %s: %r", where, exc)
        if self.faults >= MAX_FAULTS and self.enabled:
            self.enabled = False  # every class-level hook reads this and passes through
            try:  # the per-instance hook goes: vLLM's own method at full speed again
                if self.need_armed:
                    arm(self, False)
            except Exception:  # noqa: BLE001
                pass
            log.warning("kvscope probe: %d contained errors, recording switched off", self.faults)

    def close(self) -> None:
        """vLLM shut this scheduler down: every hook passes through from now on, and the
        sender flushes what the ring holds (at most ~2 s, on its own thread) and ends."""
        self.enabled = False
        if self.need_armed:
            arm(self, False)
        if self.stop is not None:
            self.stop.set()

    # -- scheduler ------------------------------------------------------------------
    def on_arrival(self, req: Any) -> None:
        sp = req.sampling_params
        self.arrivals.append(
            wire.Arrival(
                req.request_id,
                int(req.num_prompt_tokens),
                int(getattr(req, "max_tokens", 0) or (sp.max_tokens if sp else 0) or 0),
                int(req.priority),
                float(req.arrival_time),
            )
        )

    def on_end(self, req: Any) -> None:
        self.ends.append(
            wire.End(
                req.request_id,
                req.status._name_,  # the enum's name field (.name is a slow descriptor)
                int(req.num_prompt_tokens),
                int(req.num_output_tokens),
                int(req.num_preemptions),
                int(getattr(req, "num_cached_tokens", -1)),
                _wall(),
            )
        )

    def on_preempt(self, req: Any) -> None:
        victim = req.request_id
        free = self.pool.get_num_free_blocks()
        need = self.need if self.in_schedule else None
        requester = need[0] if need else None
        needed = need[1] if need else None
        if needed is not None and not 0 <= needed <= self.hello.num_blocks:
            # A count no pool could give: a manager's sentinel (HiSparse answers
            # num_gpu_blocks + 1 when its host pool is short), not a real need.
            needed = None
        requester_req = self.sched.requests.get(requester) if requester else None
        requester_prio = int(requester_req.priority) if requester_req is not None else None
        # held, not table entries: a sliding-window or Mamba group keeps vLLM's null block
        # (block 0, checked at attach: mirror.py) in place of each block it let go
        victim_blocks = sum(len(g) - g.count(0) for g in self.mgr.get_block_ids(victim))
        reason = classify(
            policy=self.policy,
            in_schedule=self.in_schedule,
            victim=victim,
            victim_priority=int(req.priority),
            requester=requester,
            requester_priority=requester_prio,
            blocks_needed=needed,
            free_blocks=free,
        )
        self.preemptions.append(
            wire.Preemption(
                victim=victim,
                victim_blocks=victim_blocks,
                victim_priority=int(req.priority),
                computed_tokens_lost=int(req.num_computed_tokens),
                free_blocks=free,
                op_index=len(self.ops),
                requester=requester,
                requester_priority=requester_prio,
                blocks_needed=needed,
                policy=self.policy,
                reason=reason,
                ts=_wall(),
            )
        )

    def waiting_head(self, held: int, queued: int) -> tuple[int, str]:
        """Blocks the head of the waiting queue needs at most (every group at its full
        length and vLLM's lookahead, before prefix hits), its ID; ``held`` and ``queued``
        are the lengths of ``kv_holding_waiting`` and ``waiting`` (vLLM's queues define
        their lengths in Python: read once a step, by ``on_step``). The head vLLM's loop
        takes first: the requests that hold KV blocks while waiting are drained first.
        (0, "") when vLLM skipped that request in this step for a reason other than blocks
        (``deferred_waiting``: a grammar compiling, a KV load, streaming input, stale
        output in flight; vLLM puts it back at the head and admits those behind it)."""
        if held:
            req = self.kv_holding.peek_request()
        elif queued:
            req = self.sched.waiting.peek_request()
        else:
            return 0, ""
        if req in self.deferred:
            return 0, ""
        n = min(req.num_tokens + self.head_extra, self.head_cap)
        sizes = self.group_block_sizes
        if len(sizes) == 1:  # most models: no generator per step
            return -(-n // sizes[0]), req.request_id
        return sum(wire.cdiv(n, bs) for bs in sizes), req.request_id

    def on_step(self, out: Any, schedule_ns: int, t_end: int) -> None:
        """After schedule(): one ring entry; a keyframe when due or after a gap.

        The Step holds vLLM's own lists, dict and sets (never modified here): ``push``
        encodes it at once, on the engine thread, before the model runner can touch them.
        """
        sched = self.sched
        ops, nulled, moved = self.take_ops()
        # Lists are replaced only when they were used: an empty one is encoded at once and
        # kept, so a quiet step allocates no container the cyclic collector must count.
        arrivals, ends, pre = self.arrivals, self.ends, self.preemptions
        if arrivals:
            self.arrivals = []
        if ends:
            self.ends = []
        if pre:
            self.preemptions = []
        free = self.pool.get_num_free_blocks()
        c = out.scheduled_cached_reqs
        nb = c.new_block_ids
        new = [wire.NewReq(r.req_id, r.block_ids, r.num_computed_tokens)
               for r in out.scheduled_new_reqs] if out.scheduled_new_reqs else _NO_NEW
        nst = out.num_scheduled_tokens
        order = (c.req_ids + [r.req_id for r in out.scheduled_new_reqs]
                 if out.scheduled_new_reqs else c.req_ids)
        if list(nst) == order:  # vLLM's usual order (no request resumed): IDs sent once
            sent, counts = _NO_IDS, list(nst.values())
        else:
            sent, counts = nst, _NO_COUNTS
        rolled = self._rolled_back(out.scheduled_spec_decode_tokens, nst)
        queued = len(sched.waiting)
        held = len(self.kv_holding) if self.kv_holding is not None else 0
        head = self.waiting_head(held, queued)
        waiting = queued + held
        audit = self.audit(sched.running, self.mgr.get_block_ids) if self.audit_due() else None
        if audit is not None and audit.mirror_fixed:  # the ledger may hold it too: resend
            self.want_keyframe = True
        ids = c.req_ids
        prev = self.prev_cached
        same = prev is not None and ids == prev  # identity compares: ~1 us at 256
        removed = None
        if same:
            listed = _NO_IDS_LIST
        else:
            listed = copy = list(ids)  # vLLM's list is not kept: the next step compares
            if prev is not None:  # a request ended or started: most often sent as the edit
                gone = out.finished_req_ids
                if out.preempted_req_ids:
                    gone = (*gone, *out.preempted_req_ids)
                removed = wire.cached_edit(prev, ids, gone)
                if removed is not None:  # only the requests appended after those kept
                    listed = copy[len(prev) - len(removed):]
            prev = copy
        dropped = self.ring_dropped
        self.push(wire.Step(
            _wall(), ops, new, sent, listed, c.num_computed_tokens,
            list(compress(c.req_ids, nb)), list(filter(None, nb)), c.resumed_req_ids,
            nulled, moved, out.finished_req_ids, out.preempted_req_ids, pre, arrivals, ends,
            out.total_num_scheduled_tokens, sched.max_num_scheduled_tokens,
            len(sched.running), waiting, head[0], head[1], free, schedule_ns,
            self.last_probe_ns, rolled, audit, counts, same, removed,
        ))
        self.prev_cached = prev if self.ring_dropped == dropped else None
        if self.repair_at is not None:
            self.repair_slice()
        due = t_end >= self.next_keyframe_ns
        if self.kf_rest is not None:
            self.keyframe_slice(t_end)  # one a step until the keyframe under way is whole
        elif self.repair_at is not None:
            pass  # no keyframe from a mirror under repair: the ledger stays stale
        elif due or (self.want_keyframe and t_end >= self.next_forced_ns):
            self.keyframe(t_end)
        # The untimed layers, estimated: the get_new_blocks wrapper per call, and the
        # need hook, armed through this step, once per scheduled request at least.
        untimed = self.allocs * self.alloc_ns + self.need_armed * len(nst) * self.need_ns
        self.allocs = 0
        self.watch_need(free)
        self.last_probe_ns = _now_ns() - t_end + self.wrap_ns + int(untimed)
        self.wrap_ns = 0

    def _rolled_back(self, spec: Any, nst: Any) -> dict[str, int]:
        """Counts of requests with drafts in the last two steps that this step did not
        schedule (with async scheduling the rejection lands a step later). Empty, at the
        cost of two truth tests, when nothing speculates."""
        recent, self.spec_prev = self.spec_prev, list(spec) if spec else _NO_IDS_LIST
        if not recent and not self.spec_prev:
            return _NO_IDS
        reqs = self.sched.requests
        out: dict[str, int] = {}
        for rid in {*recent, *self.spec_prev}.difference(nst):
            req = reqs.get(rid)
            if req is not None and not req.is_finished():
                out[rid] = req.num_computed_tokens
        return out

    def keyframe(self, t_now: int) -> None:
        """Copy the mirror (no pool scan) plus the running requests' block tables, as many
        as ``KEYFRAME_SLICE_BLOCKS`` entries allow; the rest follow, a slice a step
        (``keyframe_slice``). While a repair is under way, only ask for one when it ends."""
        if self.repair_at is not None or self.ring_full():
            self.want_keyframe = True  # built once there is room: a full ring drops it
            return
        t0 = _now_ns()
        self.settle()
        self.want_keyframe = False
        # Requests that hold KV blocks while they wait (remote KV loads) own blocks too.
        holders = [*self.sched.running, *(self.kv_holding or ())]
        tables, rest = self._tables([r.request_id for r in holders])
        tokens = {r.request_id: int(r.num_computed_tokens) for r in holders}
        self.kf_rest = rest or None  # before the push: a dropped keyframe clears it
        self.push(wire.Keyframe(self.hello, self.states, tables, tokens, rest))
        self.prev_cached = None  # the step after a keyframe carries its whole list
        self.kf_ns = _now_ns() - t0
        self._keyframe_done(t_now)

    def keyframe_slice(self, t_now: int) -> None:
        """The next slice of the keyframe under way: the tables of its requests that still
        hold blocks, read now (after this step's record, which the sidecar applies first)."""
        t0 = _now_ns()
        holding = {r.request_id for r in self.sched.running}
        if self.kv_holding:
            holding.update(r.request_id for r in self.kv_holding)
        tables, rest = self._tables([rid for rid in self.kf_rest or () if rid in holding])
        self.kf_rest = rest or None
        self.push(wire.KeyframeTables(tables, not rest))
        self.kf_ns += _now_ns() - t0
        self._keyframe_done(t_now)

    def _tables(self, rids: list[str]) -> tuple[dict[str, list[list[int]]], list[str]]:
        """The tables of the first of ``rids``, read from vLLM, up to
        ``KEYFRAME_SLICE_BLOCKS`` entries (or one table), and the requests left."""
        get_ids = self.mgr.get_block_ids
        tables: dict[str, list[list[int]]] = {}
        entries = 0
        for i, rid in enumerate(rids):
            if entries >= KEYFRAME_SLICE_BLOCKS:
                return tables, rids[i:]
            groups = tables[rid] = get_ids(rid)
            for ids in groups:
                entries += len(ids)
        return tables, []

    def _keyframe_done(self, t_now: int) -> None:
        """Once the keyframe is whole (or dropped), when the next may come: the interval,
        and at least its engine-thread time (all its slices) / ``FORCED_KEYFRAME_SHARE``."""
        if self.kf_rest is not None:
            return
        share = int(self.kf_ns / FORCED_KEYFRAME_SHARE)
        self.next_keyframe_ns = t_now + max(self.keyframe_interval_ns, share)
        self.next_forced_ns = t_now + max(int(FORCED_KEYFRAME_GAP_S * 1e9), share)
