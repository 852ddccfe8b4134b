"""Everything the sidecar knows about one engine, updated record by record.

Counters only grow while the engine's probe session lives; a new session (the engine
restarted) starts a fresh EngineState. Gauges describe the latest step.

A fresh EngineState also comes for a session the sidecar takes up while the engine runs
(the sidecar restarted: it admits the session from the probe's next keyframe), or hears
again after forgetting it: its step count (``Counters.steps``) starts from 1 again with the
engine mid-run. Each state names its count (``step_counter``), and the rows that carry a
step carry that name, so a reader of the store knows where an engine's steps restart.
"""

from __future__ import annotations

import math
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvscope.state import audit
from kvscope.state.budget_window import BudgetWindow
from kvscope.state.ledger import Ledger
from kvscope.state.token_counts import ListEdit
from kvscope_probe import wire
from kvscope_probe.identity import engine_key

_END_STATUSES = wire.END_STATUSES
MAXRUN_SAMPLE_S = 0.1  # how often max-contiguous is sampled between scrapes


@dataclass(frozen=True)
class PreemptionSeen:
    """A preemption with the ledger's own view of the pool just before it."""

    step: int
    engine: str
    model: str
    fact: wire.Preemption
    max_contiguous_free: int | None
    """Longest run of consecutive free block IDs just before; None when stale."""

    def as_json(self) -> dict[str, object]:
        """The preemption with its facts, as every API route shows it."""
        f = self.fact
        return {
            "ts": f.ts,
            "step": self.step,
            "victim": f.victim,
            "reason": f.reason,
            "policy": f.policy,
            "blocks_needed": f.blocks_needed,
            "free_blocks": f.free_blocks,
            "max_contiguous_free_blocks": self.max_contiguous_free,
            "victim_blocks": f.victim_blocks,
            "computed_tokens_lost": f.computed_tokens_lost,
            "requester": f.requester,
        }


@dataclass
class Counters:
    steps: int = 0
    scheduled_tokens: int = 0
    budget_tokens: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(wire.REASONS, 0))
    preempted_tokens: int = 0
    recomputed_tokens: int = 0
    arrivals: int = 0
    ends: dict[str, int] = field(default_factory=dict)
    schedule_seconds: float = 0.0
    probe_seconds: float = 0.0
    ledger_mismatches: int = 0
    gaps: int = 0


@dataclass
class Extremes:
    """Lowest and highest values seen since the engine connected (for summaries)."""

    min_free: int | None = None
    min_max_contiguous: int | None = None
    peak_used: int = 0
    util_sum: float = 0.0
    util_steps: int = 0
    util_at_zero_free_sum: float = 0.0
    util_at_zero_free_steps: int = 0


Listener = Callable[[str, "EngineState", object], None]


def _check_step(s: wire.Step) -> None:
    """Raise ValueError, before anything of the step is applied, when a figure that feeds
    a counter is negative (counters never go down) or its time is not finite."""
    if (s.scheduled_tokens < 0 or s.token_budget < 0 or s.schedule_ns < 0 or s.probe_ns < 0
            or not math.isfinite(s.ts)):
        raise ValueError(f"step with a negative count or time {s.ts!r}: scheduled "
                         f"{s.scheduled_tokens}, budget {s.token_budget}, schedule_ns "
                         f"{s.schedule_ns}, probe_ns {s.probe_ns}")
    for p in s.preemptions:  # rare: a few a step at most
        if p.computed_tokens_lost < 0:
            raise ValueError(f"preemption of {p.victim!r} lost {p.computed_tokens_lost} tokens")


class EngineState:
    """Ingests one probe session's records in order."""

    def __init__(self, hello: wire.Hello, listeners: list[Listener] | None = None) -> None:
        self.hello = hello
        self.server = hello.server
        """Server label; the hub adds ``#<pid>`` when another live probe holds the identity."""
        self.key = engine_key(hello.server, hello.engine)
        """Unique name of this engine in the sidecar (set by kvscope.state.hub)."""
        self.ledger = Ledger(hello.num_blocks, [g.block_size for g in hello.kv_groups],
                             [g.kind for g in hello.kv_groups])
        self.counters = Counters()
        self.step_counter = secrets.token_hex(8)
        """This state's step count, named: ``counters.steps`` counts from 1 at the first
        step this state ingested, which is the engine's first only when the sidecar heard
        the session from its hello."""
        self.audit = audit.AuditCounts()
        """The ledger compared with vLLM's own pool (``kvscope.state.audit``)."""
        self.extremes = Extremes()
        self.listeners = listeners if listeners is not None else []
        self.next_seq = 0
        self.prev_cached: list[str] | None = None
        """The last step's ``cached_ids``, for a step that sends "the same" (None after a
        gap)."""
        self.last_step: wire.Step | None = None
        self.last_record_monotonic = time.monotonic()
        self.probe_dropped = 0
        self.sender_cpu_ns = 0
        self.io_cpu_ns = 0
        self.ring_bytes = 0
        self.ring_limit_bytes = 0
        self.probe_faults = 0
        self.recent_preemptions: deque[PreemptionSeen] = deque(maxlen=200)
        self.lost_tokens: dict[str, int] = {}
        self.budget_window = BudgetWindow()
        """Cumulative scheduled tokens and token budget of the last steps."""
        self.keyframe_running: set[str] = set()
        """The requests running at the last keyframe, until the request tracker has taken
        up those it did not know (admitted before this sidecar heard the session, or in a
        gap): ``RequestTracker._take_up``."""
        self._maxrun = 0
        self._maxrun_at = 0.0
        self.history: deque[tuple[float, int, int]] = deque(maxlen=4000)
        """(sidecar monotonic time, preemptions, requests ended), about one a second."""

    @property
    def engine(self) -> str:
        return self.hello.engine

    # -- frames ---------------------------------------------------------------------
    def note_frame(self, frame: wire.Frame) -> None:
        """Check continuity; a gap, or a fault the probe contained since the last frame
        (its mirror may be under repair), makes the ledger stale until the next keyframe."""
        if frame.first_seq != self.next_seq:
            self.counters.gaps += 1
            self.ledger.stale()
            self.prev_cached = None
        if frame.faults > self.probe_faults:
            self.ledger.stale()
        self.next_seq = frame.first_seq + len(frame.records)
        self.probe_dropped = frame.dropped
        self.sender_cpu_ns = max(self.sender_cpu_ns, frame.sender_cpu_ns)
        self.io_cpu_ns = max(self.io_cpu_ns, frame.io_cpu_ns)
        self.ring_bytes = frame.ring_bytes
        self.ring_limit_bytes = frame.ring_limit_bytes
        self.probe_faults = frame.faults
        self.last_record_monotonic = time.monotonic()

    def ingest(self, record: wire.Record) -> None:
        if isinstance(record, wire.Step):
            self._step(record)
        elif isinstance(record, wire.Keyframe):
            if record.hello.num_blocks != self.ledger.num_blocks:
                raise ValueError("keyframe pool size differs from hello")
            if self.ledger.load(record):
                self.counters.ledger_mismatches += 1
            self.keyframe_running = set(record.tokens)
            self._sample_maxrun(force=True)
        elif isinstance(record, wire.KeyframeTables):
            if self.ledger.load_tables(record):
                self.counters.ledger_mismatches += 1
        elif not isinstance(record, wire.Hello):
            raise ValueError(f"{type(record).__name__} in an engine frame")

    # -- steps --------------------------------------------------------------------------
    def _resolve(self, s: wire.Step) -> tuple[wire.Step, ListEdit | None]:
        """The step with its ``cached_ids`` written out, whichever compact form the probe
        sent (wire versions 3 and 4), and its scheduled counts checked against the requests
        they are for (the ledger applies them in place, no dict of them is built: read them
        through ``wire.scheduled_tokens_of``); remembers the list for the next. With it, the
        edit the list was rebuilt from (the previous list, the positions taken out), for
        the token counts to follow (``TokenCounts.step``); None otherwise."""
        edit: ListEdit | None = None
        if s.cached_same or s.cached_removed is not None:
            prev = self.prev_cached
            if prev is None:  # a record was missed: the list is unknown until the probe
                self.ledger.stale()  # resends it (after its next keyframe)
                return msgspec.structs.replace(
                    s, cached_same=False, cached_removed=None, cached_ids=[],
                    cached_computed=[], scheduled_counts=[], num_scheduled={}), None
            if s.cached_same:
                ids = prev
            else:
                ids = wire.apply_cached_edit(prev, s.cached_removed, s.cached_ids)
                edit = (prev, s.cached_removed)
            if len(ids) != len(s.cached_computed):
                raise ValueError(f"{len(s.cached_computed)} computed counts for the "
                                 f"{len(ids)} requests of the previous step's list"
                                 f"{' as edited' if edit else ''}")
            s = msgspec.structs.replace(s, cached_ids=ids, cached_same=False,
                                        cached_removed=None)
        self.prev_cached = s.cached_ids
        if s.scheduled_counts:  # the IDs came once (cached_ids, new_reqs)
            wire.scheduled_ids(s)  # raises before anything is applied when they do not match
        return s, edit

    def _step(self, s: wire.Step) -> None:
        _check_step(s)
        s, edit = self._resolve(s)
        led = self.ledger
        c = self.counters
        c.steps += 1
        c.scheduled_tokens += s.scheduled_tokens
        c.budget_tokens += s.token_budget
        c.schedule_seconds += s.schedule_ns / 1e9
        c.probe_seconds += s.probe_ns / 1e9
        c.arrivals += len(s.arrivals)

        seen: list[PreemptionSeen] = []
        if s.preemptions:
            seen = self._preemptions(s)
        else:  # most steps: the ops in one go
            led.apply(s.ops)
        led.apply_tables(s, edit)
        if self.lost_tokens:  # only requests preempted before can resume
            for r in s.new_reqs:
                self._resumed(r.req_id, r.computed_tokens)
            if s.resumed:
                computed = dict(zip(s.cached_ids, s.cached_computed, strict=True))
                for rid in s.resumed:
                    self._resumed(rid, computed.get(rid, 0))
        for e in s.ends:
            status = e.status if e.status in _END_STATUSES else "other"  # a bounded label
            c.ends[status] = c.ends.get(status, 0) + 1
            self.lost_tokens.pop(e.req_id, None)

        if led.synced and led.free != s.free_blocks:
            c.ledger_mismatches += 1
            led.stale()
        if s.audit is not None and audit.check(self.audit, led, s.audit):
            led.stale()
        self.last_step = s
        now = time.monotonic()
        if not self.history or now - self.history[-1][0] >= 1.0:
            self.history.append((now, sum(c.preemptions.values()), sum(c.ends.values())))
        self.budget_window.add(s.ts, c.scheduled_tokens, c.budget_tokens)
        self._track(s, now)
        for p in seen:
            self.recent_preemptions.append(p)
        early: list[PreemptionSeen] = []
        if seen and (s.new_reqs or s.resumed):
            # A victim resumed in this step was preempted before its schedule(), by
            # reset_prefix_cache(reset_running_requests=True) (0.32 scheduler.py 2858):
            # a step that preempts resumes nothing (900). Listeners hear it first.
            back = {r.req_id for r in s.new_reqs}.union(s.resumed)
            early = [p for p in seen if p.fact.victim in back]
            seen = [p for p in seen if p.fact.victim not in back]
        for fn in self.listeners:
            for p in early:
                fn("preemption", self, p)
            fn("step", self, s)
            for p in seen:
                fn("preemption", self, p)

    def _preemptions(self, s: wire.Step) -> list[PreemptionSeen]:
        """Apply the step's ops in pieces, each preemption's facts with the pool as it
        was when it happened (its ``op_index``), and count them."""
        led, c = self.ledger, self.counters
        pos = 0
        seen: list[PreemptionSeen] = []
        for p in sorted(s.preemptions, key=lambda p: p.op_index):
            led.apply(s.ops[pos : p.op_index])
            pos = p.op_index
            maxrun = led.max_contiguous_free() if led.synced else None
            seen.append(PreemptionSeen(c.steps, self.engine, self.hello.model, p, maxrun))
        led.apply(s.ops[pos:])
        for p in s.preemptions:
            c.preemptions[p.reason if p.reason in c.preemptions else "unknown"] += 1
            c.preempted_tokens += p.computed_tokens_lost
            self.lost_tokens[p.victim] = p.computed_tokens_lost
        return seen

    def _resumed(self, req_id: str, computed_at_resume: int) -> None:
        lost = self.lost_tokens.pop(req_id, None)
        if lost is not None:
            self.counters.recomputed_tokens += max(0, lost - computed_at_resume)

    def _track(self, s: wire.Step, now: float) -> None:
        """The step into the extremes; the longest free run sampled when due."""
        ex = self.extremes
        util = s.scheduled_tokens / s.token_budget if s.token_budget else 0.0
        ex.util_sum += util
        ex.util_steps += 1
        led = self.ledger
        if not led.synced:
            return
        free = led.free
        if ex.min_free is None or free < ex.min_free:
            ex.min_free = free
        used = led.usable_blocks - free  # led.used
        if used > ex.peak_used:
            ex.peak_used = used
        if free == 0:
            ex.util_at_zero_free_sum += util
            ex.util_at_zero_free_steps += 1
        if now - self._maxrun_at >= MAXRUN_SAMPLE_S:
            self._sample_maxrun(now=now)

    def _sample_maxrun(self, force: bool = False, now: float | None = None) -> None:
        if now is None:
            now = time.monotonic()
        if not self.ledger.synced or (not force and now - self._maxrun_at < MAXRUN_SAMPLE_S):
            return
        self._maxrun_at = now
        self._maxrun = self.ledger.max_contiguous_free()
        ex = self.extremes
        if ex.min_max_contiguous is None or self._maxrun < ex.min_max_contiguous:
            ex.min_max_contiguous = self._maxrun

    # -- derived -------------------------------------------------------------------------
    def sampled_max_contiguous_free(self) -> int:
        """The longest free run as last sampled (at most MAXRUN_SAMPLE_S ago)."""
        self._sample_maxrun()
        return self._maxrun

    def max_contiguous_free(self) -> int:
        """Fresh value (computed now); also folds into the sampled minimum."""
        self._sample_maxrun(force=True)
        return self._maxrun

    def budget_utilization(self, window_s: float = 10.0) -> float | None:
        """Scheduled tokens / token budget over the engine's last ``window_s`` seconds."""
        util = self.budget_window.utilization(window_s)
        if util is None:  # one step in the window (or none): that step's own
            last = self.last_step
            if last is None or not last.token_budget:
                return None
            return last.scheduled_tokens / last.token_budget
        return util
