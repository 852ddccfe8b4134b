"""Layers 2 and 4: per-request traces, lifecycle events, decisions and per-second rollups.

A ``RequestTracker`` listens to EngineState events (it runs on the receiver thread, after
the ledger has applied each step) and emits rows from ``kvscope.rows`` to one
callable. It keeps a little state per live request (``request_tables.Live``), bounded:
requests whose end never arrives (a gap) are evicted oldest first and counted. The
per-second rollups and admission decisions are ``rollups.Rollups``.

A request's block allocations (with 16-token blocks ~16 of 256 decoding requests grow a
block every step) are not a row each: ``request_allocations.Allocations`` collects them per
request and writes one ``RequestAllocations`` row of arrays when the request is preempted
or ends, and for every request still growing every ``FLUSH_EVERY_S`` (5) seconds of
engine time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvscope.rows import EngineConfig, RequestEvent, RequestTrace, SchedulerDecision
from kvscope.state.engine import EngineState, PreemptionSeen
from kvscope.state.request_allocations import Allocations
from kvscope.state.request_tables import Live, extend_table, set_table
from kvscope.state.rollups import Rollups
from kvscope_probe import wire

Emit = Callable[[Any], None]
MAX_LIVE_REQUESTS = 100_000
END_DECISIONS = {"FINISHED_ABORTED": ("abort", "Aborted"), "FINISHED_ERROR": ("error", "Failed")}
"""A request's end in the decision log by vLLM's status: ``finish`` (``Finished``) for
the others (stopped, length-capped, ignored, repetition)."""
CONFIG_EVERY_S = 3600.0
"""Engine seconds after which an engine's ``engine_configs`` row is written again (stamped
with the step that writes it): readers take the latest row at or before a request, and
the store drops rows ``--clickhouse-ttl-days`` after their time, so a row written once
at the probe's hello was gone after that much uptime while the engine's requests kept
coming."""


class RequestTracker:
    """Turns one engine stream into rows; register ``on_event`` as a Hub listener."""

    def __init__(self, emit: Emit, wants: Callable[[str], bool] | None = None) -> None:
        self.emit = emit
        self.wants = wants or (lambda table: True)
        """Whether a table's rows are taken at all (``SinkManager.wants``): the per-step
        events and decisions are not built when no sink takes them."""
        self.live: dict[str, OrderedDict[str, Live]] = {}
        self.rollups = Rollups(emit, self._decision)
        self.prefilling: dict[str, set[str]] = {}
        self.allocations: dict[str, Allocations] = {}
        self.config_due: dict[str, float] = {}
        """Engine time at which each engine's settings row is written again."""
        self.evicted = 0

    # -- dispatch -----------------------------------------------------------------
    def on_event(self, kind: str, st: EngineState, payload: object) -> None:
        if kind == "hello":
            old = self.allocations.pop(st.key, None)
            if old is not None:  # a restarted engine: what the old one grew is written
                old.flush_all(self.emit)
            self.live[st.key] = OrderedDict()
            self.prefilling[st.key] = set()
            self.rollups.forget(st.key)
            if self.wants("engine_configs"):
                self.emit(engine_config(st))
            self.config_due[st.key] = st.hello.ts + CONFIG_EVERY_S
        elif kind == "step":
            self._step(st, payload)  # type: ignore[arg-type]
        elif kind == "preemption":
            self._preemption(st, payload)  # type: ignore[arg-type]
        elif kind == "forget":  # the hub dropped the engine: so does the tracker
            old = self.allocations.pop(st.key, None)
            if old is not None:
                old.flush_all(self.emit)
            for held in (self.live, self.prefilling, self.config_due):
                held.pop(st.key, None)
            self.rollups.forget(st.key)

    _events_wanted = _decisions_wanted = _allocations_wanted = True

    def _wanted(self) -> None:
        """Asked once a step (a sink may be added while running)."""
        self._events_wanted = self.wants("request_events")
        self._decisions_wanted = self.wants("scheduler_decisions")
        self._allocations_wanted = self.wants("request_allocations")

    def _allocs(self, st: EngineState) -> Allocations:
        a = self.allocations.get(st.key)
        if a is None:
            a = self.allocations[st.key] = Allocations(st.hello.model, st.engine, st.server,
                                                       st.step_counter)
        return a

    def _flush_allocations(self, st: EngineState, rid: str) -> None:
        """Write ``rid``'s open run of allocations (before its preemption or end)."""
        allocs = self.allocations.get(st.key)
        if allocs is not None:
            allocs.flush(rid, self.emit)

    def _reqs(self, st: EngineState) -> OrderedDict[str, Live]:
        reqs = self.live.get(st.key)
        if reqs is None:
            reqs = self.live[st.key] = OrderedDict()
        return reqs

    def _event(self, st: EngineState, ts: float, rid: str, event: str, *, blocks: int = -1,
               total_blocks: int = -1, free_blocks: int | None = None,
               max_contiguous_free: int = -1, tokens: int = -1, reason: str = "",
               detail: str = "", requester: str = "") -> None:
        """A ``request_events`` row; ``free_blocks`` by default the ledger's now."""
        if not self._events_wanted:
            return
        if free_blocks is None:
            led = st.ledger
            free_blocks = led.free if led.synced else -1
        self.emit(RequestEvent(
            ts=ts, model=st.hello.model, engine=st.engine, server=st.server, request_id=rid,
            event=event, step=st.counters.steps, blocks=blocks, total_blocks=total_blocks,
            free_blocks=free_blocks, max_contiguous_free=max_contiguous_free, tokens=tokens,
            reason=reason, detail=detail, requester=requester, step_counter=st.step_counter))

    def _decision(self, st: EngineState, ts: float, decision: str, rid: str, msg: str,
                  **kw: Any) -> None:
        if not self._decisions_wanted:
            return
        self.emit(SchedulerDecision(
            ts=ts, model=st.hello.model, engine=st.engine, server=st.server, decision=decision,
            request_id=rid,
            reason=kw.get("reason", ""), blocks_needed=kw.get("blocks_needed", -1),
            free_blocks=kw.get("free_blocks", -1), max_contiguous_free=kw.get("maxrun", -1),
            tokens=kw.get("tokens", -1), policy=st.hello.policy, msg=msg))

    # -- steps ----------------------------------------------------------------------
    def _step(self, st: EngineState, s: wire.Step) -> None:
        """Rows for one step. Runs after the ledger applied it: per-request work is done
        only for requests that arrived, were admitted, resumed, grew or ended."""
        self._wanted()
        reqs = self._reqs(st)
        led = st.ledger
        free = led.free if led.synced else -1
        pending = self._pending(st)
        for i, a in enumerate(s.arrivals):  # in the order the scheduler queued them
            reqs[a.req_id] = Live(a.arrival_time, a.prompt_len, a.max_tokens)
            self._event(st, a.arrival_time, a.req_id, "queued", tokens=0,
                        detail=f"position={i} priority={a.priority}")
        # Sampled (at most MAXRUN_SAMPLE_S old): a scan of the pool per admitting step
        # would cost the sidecar more than the rest of the step at 128k blocks.
        maxrun = st.sampled_max_contiguous_free() if (s.new_reqs and led.synced) else -1
        for r in s.new_reqs:
            live = reqs.get(r.req_id) or reqs.setdefault(r.req_id,
                                                          Live(s.ts, arrival_seen=False))
            first = live.admitted_ts < 0
            if first:
                live.admitted_ts, live.free_at_alloc, live.maxrun_at_alloc = s.ts, free, maxrun
                live.cached_tokens = r.computed_tokens
            set_table(live, led.tables.get(r.req_id, r.block_ids))
            self._event(st, s.ts, r.req_id, "admitted" if first else "resumed",
                        blocks=live.blocks, total_blocks=live.blocks, free_blocks=free,
                        max_contiguous_free=maxrun, tokens=self._tokens(led, r.req_id))
            if not first:
                self._resumed(st, s, live, r.req_id, r.computed_tokens)
            pending.add(r.req_id)
        resumed = set(s.resumed) if s.resumed else None  # one lookup per growth, not a scan
        allocs = self._allocs(st) if self._allocations_wanted else None
        add = None
        if allocs is not None:
            allocs.at(s.ts, st.counters.steps, free)
            add = allocs.add
        tokens, live_of = led.counts.tokens_of, reqs.get
        dropped = self._dropped(s, reqs, add, tokens) if s.nulled else None
        for rid, groups in zip(s.grown_ids, s.grown_blocks, strict=True):  # ~16 at 256 running
            live = live_of(rid)
            if live is None:
                if resumed is None or rid not in resumed:
                    continue
                # preempted before this sidecar heard the engine, resumed now: taken up,
                # what its preemption discarded unknown
                live = reqs[rid] = Live(s.ts, arrival_seen=False, admitted_ts=s.ts,
                                        lost_tokens=-1)
            if resumed is not None and rid in resumed:
                set_table(live, groups)
                self._event(st, s.ts, rid, "resumed", blocks=live.blocks,
                            total_blocks=live.blocks, free_blocks=free,
                            tokens=self._tokens(led, rid))
                hits = led.counts.computed_of(rid)
                self._resumed(st, s, live, rid, hits)
                pending.add(rid)
                continue
            last = live.last_ids
            if len(groups) == 1 and len(ids := groups[0]) == 1 and len(last) == 1:
                # most growths (~16 a step at 256 running): one group, one block
                b = ids[0]
                live.fragments += b != last[0] + 1
                last[0] = b
                blocks = live.blocks = live.blocks + 1
                if blocks > live.peak_blocks:
                    live.peak_blocks = blocks
                if add is not None:
                    add(rid, 1, blocks, tokens(rid))
                continue
            n = extend_table(live, groups)  # 0 when no group grew: no allocation then
            if n and add is not None:
                add(rid, n, live.blocks, tokens(rid))
        if dropped:  # the tables as the step left them: their runs (and blocks again)
            for rid in dropped:
                live = reqs.get(rid)
                if live is not None and rid in led.tables:
                    set_table(live, led.tables[rid])
        if pending:
            self._first_tokens(reqs, pending, led, s)
        if st.keyframe_running:  # after a keyframe (every few seconds): ~running lookups
            self._take_up(st, reqs, s)
        for e in s.ends:
            pending.discard(e.req_id)
            self._flush_allocations(st, e.req_id)
            self._end(st, e, reqs.pop(e.req_id, None))
        self.rollups.admission(st, s)
        self.rollups.step(st, s)
        while len(reqs) > MAX_LIVE_REQUESTS:
            rid, _ = reqs.popitem(last=False)
            pending.discard(rid)
            self._flush_allocations(st, rid)
            self.evicted += 1
        if allocs is not None:
            allocs.flush_due(s.ts, self.emit)
        if s.ts >= self.config_due.get(st.key, s.ts):
            self.config_due[st.key] = s.ts + CONFIG_EVERY_S
            if self.wants("engine_configs"):
                self.emit(engine_config(st, s.ts))

    def _take_up(self, st: EngineState, reqs: OrderedDict[str, Live], s: wire.Step) -> None:
        """Requests running at the last keyframe that the tracker does not know: admitted
        before this sidecar heard the engine (it restarted, or started late) or in a gap.
        Each is followed from its keyframe table on, with a ``taken_up`` event holding that
        table, so its end writes a trace: its blocks from that table on, vLLM's own figures
        from its end, every time unknown, its arrival dated this step (the latest it can
        have arrived). One whose table follows in a keyframe slice waits for it; one that
        ends before it is heard holds unknown blocks (-1)."""
        led = st.ledger
        ending = {e.req_id for e in s.ends} if s.ends else set()
        waiting: set[str] = set()
        free = led.free if led.synced else -1
        for rid in st.keyframe_running:
            if rid in reqs:
                continue
            table = led.tables.get(rid)
            if table is None and rid not in ending:
                if led.awaiting:  # its table comes in a keyframe slice
                    waiting.add(rid)
                continue  # preempted since the keyframe: its resume takes it up
            live = reqs[rid] = Live(s.ts, arrival_seen=False, admitted_ts=s.ts)
            if table is None:
                live.peak_blocks = live.fragments = held = -1
            else:
                set_table(live, table)
                held = live.blocks
            self._event(st, s.ts, rid, "taken_up", blocks=held, total_blocks=held,
                        free_blocks=free, tokens=self._tokens(led, rid) if held >= 0 else -1,
                        detail="running when this sidecar took the engine up")
        st.keyframe_running = waiting

    @staticmethod
    def _dropped(s: wire.Step, reqs: OrderedDict[str, Live], add: Any,
                 tokens: Callable[[str], int]) -> set[str]:
        """Blocks a sliding-window group gave back (vLLM's remove_skipped_blocks, before
        the step's growth in allocate_slots): counted off, and an allocation entry of
        minus that many written, so the stored holding (the total blocks of a request's
        last event) follows them. A request whose whole table came in this step (admitted
        or resumed) is counted from that table. The requests whose blocks dropped."""
        whole = {r.req_id for r in s.new_reqs}.union(s.resumed)
        out: set[str] = set()
        for n in s.nulled:
            rid = n.req_id
            live = reqs.get(rid)
            if live is None or rid in whole:
                continue
            k = len(n.block_ids) - n.block_ids.count(0)  # 0: the null block, never held
            if k:
                live.blocks -= k
                out.add(rid)
                if add is not None:
                    add(rid, -k, live.blocks, tokens(rid))
        return out

    def _pending(self, st: EngineState) -> set[str]:
        """Requests admitted whose first output token has not been seen yet."""
        pending = self.prefilling.get(st.key)
        if pending is None:
            pending = self.prefilling[st.key] = set()
        return pending

    @staticmethod
    def _tokens(led: Any, rid: str) -> int:
        return led.counts.tokens_of(rid)

    def _first_tokens(self, reqs: OrderedDict[str, Live], pending: set[str], led: Any,
                      s: wire.Step) -> None:
        if not pending:
            return
        sched: Any = s.num_scheduled
        if s.scheduled_counts:  # the requests scheduled this step: cached_ids, new_reqs
            listed = led.counts.positions_of(s.cached_ids)  # cached_ids' (a dict, read)
            if listed is None:
                sched = set(wire.scheduled_ids(s))
            else:
                new = [r.req_id for r in s.new_reqs]
                sched = _Either(listed, new) if new else listed
        for rid in [r for r in pending if r in sched]:
            live = reqs.get(rid)
            if live is None:
                pending.discard(rid)
            elif live.first_token_ts >= 0:
                pending.discard(rid)
            elif live.prompt_len and self._tokens(led, rid) >= live.prompt_len:
                live.first_token_ts = s.ts
                pending.discard(rid)

    def _resumed(self, st: EngineState, s: wire.Step, live: Live, rid: str, hits: int) -> None:
        """A ``resume`` decision; what it computes again is unknown (-1) for a request
        preempted before this sidecar took the engine up (``lost_tokens`` -1)."""
        redo = -1 if live.lost_tokens < 0 else max(0, live.lost_tokens - hits)
        if redo > 0:
            live.recomputed += redo
        live.lost_tokens = 0
        again = (f"recomputing {redo} tokens" if redo >= 0 else
                 "recomputing what a preemption before this sidecar took the engine up "
                 "discarded (unknown)")
        self._decision(st, s.ts, "resume", rid,
                       f"Resuming request {rid} after preemption, {again} "
                       f"blocks={live.blocks}", tokens=redo,
                       free_blocks=st.ledger.free if st.ledger.synced else -1)

    def _preemption(self, st: EngineState, p: PreemptionSeen) -> None:
        f = p.fact
        self._flush_allocations(st, f.victim)
        live = self._reqs(st).get(f.victim)
        if live is not None:
            live.preemptions += 1
            live.last_reason = f.reason
            live.lost_tokens = f.computed_tokens_lost
            live.blocks = 0
            live.last_ids = []
        maxrun = -1 if p.max_contiguous_free is None else p.max_contiguous_free
        needed = -1 if f.blocks_needed is None else f.blocks_needed
        self._event(st, f.ts, f.victim, "preempted", blocks=f.victim_blocks, total_blocks=0,
                    free_blocks=f.free_blocks, max_contiguous_free=maxrun,
                    tokens=f.computed_tokens_lost, reason=f.reason,
                    detail=f"requester={f.requester or ''} blocks_needed={needed}",
                    requester=f.requester or "")
        self._decision(st, f.ts, "preempt", f.victim,
                       f"Preempting request {f.victim} due to {f.reason} "
                       f"free_blocks={f.free_blocks} max_contiguous={maxrun} "
                       f"blocks_needed={needed}",
                       reason=f.reason, blocks_needed=needed, free_blocks=f.free_blocks,
                       maxrun=maxrun, tokens=f.computed_tokens_lost)

    def _end(self, st: EngineState, e: wire.End, live: Live | None) -> None:
        aborted = e.status == "FINISHED_ABORTED"
        self._event(st, e.ts, e.req_id, "aborted" if aborted else "finished",
                    tokens=e.prompt_len + e.output_len, detail=e.status)
        decision, verb = END_DECISIONS.get(e.status, ("finish", "Finished"))
        self._decision(st, e.ts, decision, e.req_id,
                       f"{verb} request {e.req_id} "
                       f"status={e.status} output_tokens={e.output_len} "
                       f"preemptions={e.num_preemptions}", tokens=e.output_len)
        if live is None:
            return
        groups = st.hello.kv_groups
        arrival = live.arrival_ts
        seen = live.arrival_seen  # else every time from the arrival is unknown (-1)
        self.emit(RequestTrace(
            ts=e.ts, model=st.hello.model, engine=st.engine, server=st.server, request_id=e.req_id,
            prompt_len=e.prompt_len, max_gen_len=live.max_tokens if seen else -1,
            output_len=e.output_len,
            required_blocks=sum(wire.cdiv(e.prompt_len + e.output_len, g.block_size)
                                for g in groups),
            allocated_blocks=live.peak_blocks,
            contiguous_allocated=live.fragments == len(groups) and live.peak_blocks > 0,
            block_fragments=live.fragments,
            preempt_count=e.num_preemptions, preempt_reason=live.last_reason,
            recomputed_tokens=(live.recomputed if seen or live.preemptions >= e.num_preemptions
                               else -1),  # preempted before this sidecar took it up
            cached_tokens=live.cached_tokens if live.cached_tokens >= 0 else e.cached_tokens,
            free_blocks_at_alloc=live.free_at_alloc,
            max_contiguous_free_blocks_at_alloc=live.maxrun_at_alloc,
            arrival_ts=arrival,
            queue_seconds=(live.admitted_ts - arrival
                           if live.admitted_ts >= 0 and seen else -1.0),
            first_token_seconds=(live.first_token_ts - arrival
                                 if live.first_token_ts >= 0 and seen else -1.0),
            e2e_seconds=e.ts - arrival if seen else -1.0, finish_reason=e.status))

    # -- admission and rollups ---------------------------------------------------------

    def flush_allocations(self) -> None:
        """Write every engine's open allocation runs now (before a read of the store);
        the caller holds the hub's lock."""
        for allocs in self.allocations.values():
            allocs.flush_all(self.emit)

    def flush(self, hub_engines: dict[str, EngineState]) -> None:
        """Emit the open per-second rollups and the allocations not written yet (at
        shutdown)."""
        self.rollups.flush(hub_engines)
        for allocs in self.allocations.values():
            allocs.flush_all(self.emit)


class _Either:
    """In one of two containers (the step's listed requests, or its few new ones)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def __contains__(self, x: object) -> bool:
        return x in self.a or x in self.b


def engine_config(st: EngineState, ts: float | None = None) -> EngineConfig:
    """The ``engine_configs`` row of ``st``'s probe session, from its hello; stamped with
    the hello's time, or ``ts`` (written again: ``CONFIG_EVERY_S``)."""
    h = st.hello
    return EngineConfig(
        ts=h.ts if ts is None else ts, model=h.model, engine=st.engine, server=st.server,
        session=h.session,
        vllm_version=h.vllm_version, num_blocks=h.num_blocks, block_size=h.block_size,
        kv_group_kinds=[g.kind for g in h.kv_groups],
        kv_group_block_sizes=[g.block_size for g in h.kv_groups],
        kv_group_windows=[g.sliding_window for g in h.kv_groups],
        token_budget=h.token_budget, max_num_batched_tokens=h.max_num_batched_tokens,
        max_num_seqs=h.max_num_seqs, max_model_len=h.max_model_len, policy=h.policy,
        prefix_caching=h.prefix_caching, async_scheduling=h.async_scheduling,
        spec_tokens=h.spec_tokens, watermark_blocks=h.watermark_blocks)
