"""Layer 4's per-engine aggregates: per-second step rollups (StepStat rows) and the
admission decisions read from the head of the waiting queue (``admission_blocked``,
``never_fits``). Driven by ``RequestTracker`` after the ledger applied each step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscope.rows import StepStat
from kvscope.state.capacity import admission_free, head_fit
from kvscope.state.engine import EngineState
from kvscope_probe import wire

BLOCKED_REPEAT_S = 10.0
Decide = Callable[..., None]
"""``decide(st, ts, decision, request_id, msg, **figures)``: emits a SchedulerDecision."""


@dataclass
class Second:
    """Accumulates one engine-second of steps for StepStat."""

    start: float
    steps: int = 0
    scheduled: int = 0
    budget: int = 0
    min_free: int = -1
    sum_free: int = 0
    free_samples: int = 0
    min_maxrun: int = -1
    max_used: int = 0
    sum_running: int = 0
    max_waiting: int = 0
    preemptions: int = 0



def admission_limit(st: EngineState, s: wire.Step) -> str:
    """What stopped vLLM's waiting loop first in a step that admitted nothing, in the order
    it checks (vLLM 0.32 ``Scheduler.schedule``: ``if not preempted_reqs``, then ``while
    token_budget > 0``, then ``num_running >= max_num_active_reqs`` inside the loop):
    ``preempted`` (a step that preempted admits nothing), ``token_budget`` (the running
    requests took the step's whole budget), ``max_num_seqs`` (as many running as
    ``--max-num-seqs``), else ``kv_blocks``: none of these held, and the pool lacks the
    blocks the head needs. Only called while the head's upper bound exceeds the free
    blocks. Limits the step does not carry are not told apart from the pool's
    (``--max-num-active-seqs`` below ``--max-num-seqs``, LoRA slots, the input budget
    parallel drafting keeps for draft slots, a paused scheduler, vLLM 0.33's
    ``prefill_schedule_interval`` when it is above 1)."""
    if s.preemptions or s.preempted:
        return "preempted"
    if s.scheduled_tokens >= s.token_budget:
        return "token_budget"
    if s.running >= st.hello.max_num_seqs:
        return "max_num_seqs"
    return "kv_blocks"


class Rollups:
    """Per engine key: the open second, and the admission state of its waiting head."""

    def __init__(self, emit: Callable[[Any], None], decide: Decide) -> None:
        self.emit = emit
        self.decide = decide
        self.seconds: dict[str, Second] = {}
        self.blocked_since: dict[str, float] = {}
        self.never_fit_head: dict[str, str] = {}

    def forget(self, key: str) -> None:
        """A new probe session under ``key``: its old second and head are gone."""
        self.seconds.pop(key, None)
        self.never_fit_head.pop(key, None)

    def admission(self, st: EngineState, s: wire.Step) -> None:
        """An ``admission_blocked`` decision (at most every BLOCKED_REPEAT_S per engine)
        while the head of the waiting queue needs more blocks than vLLM lets it take (the
        free ones, less ``--watermark``'s reserve while requests run)."""
        if self._never_fits(st, s):
            return
        led = st.ledger
        # admitted: new requests, and preempted ones taken back from the waiting queue
        # (vLLM 0.32 lists those in resumed_req_ids, not among the new ones)
        blocked = s.waiting > 0 and not s.new_reqs and not s.resumed and led.synced
        free_for_it = admission_free(st.hello, led.free, s.running) if blocked else 0
        if not (blocked and s.head_blocks_needed > free_for_it):
            self.blocked_since.pop(st.key, None)
            return
        last = self.blocked_since.get(st.key)
        if last is not None and s.ts - last < BLOCKED_REPEAT_S:
            return
        self.blocked_since[st.key] = s.ts
        wm = led.free - free_for_it  # the --watermark reserve held back, 0 without one
        self.decide(st, s.ts, "admission_blocked", s.head_req_id,
                    f"Admission blocked: request {s.head_req_id} at the head of the "
                    f"waiting queue needs at most {s.head_blocks_needed} blocks, "
                    f"free_blocks={led.free}" + (f" watermark_blocks={wm}" if wm else "")
                    + f" waiting={s.waiting}",
                    reason=admission_limit(st, s),
                    blocks_needed=s.head_blocks_needed, free_blocks=led.free)

    def _never_fits(self, st: EngineState, s: wire.Step) -> bool:
        """One ``never_fits`` decision per request that reaches the head of the waiting
        queue needing more blocks than the pool holds; True while such a head waits (it
        is not reported as ``admission_blocked``: no freed block would admit it)."""
        # The lower bound is at most the upper bound - 1 + one block per group (the token
        # count that first reaches the upper bound adds at most one block to each group):
        # when that fits the usable blocks, the head fits, with no search for it per step.
        if s.head_blocks_needed + max(1, len(st.hello.kv_groups)) <= st.hello.num_blocks:
            self.never_fit_head.pop(st.key, None)
            return False
        fit = head_fit(st.hello, s)
        if fit is None or not fit.never_fits:
            self.never_fit_head.pop(st.key, None)
            return False
        if self.never_fit_head.get(st.key) != fit.req_id:
            self.never_fit_head[st.key] = fit.req_id
            self.decide(st, s.ts, "never_fits", fit.req_id,
                        f"Never fits: request {fit.req_id} at the head of the waiting "
                        f"queue needs at least {fit.min_blocks} blocks, more than the "
                        f"{fit.usable_blocks} usable blocks of the whole pool; it and the "
                        f"{s.waiting - 1} requests behind it wait while it stays there",
                        blocks_needed=fit.min_blocks, free_blocks=st.ledger.free
                        if st.ledger.synced else -1)
        return True

    def step(self, st: EngineState, s: wire.Step) -> None:
        """Fold one step into its engine-second; emit the second before when it ends."""
        second = float(int(s.ts))
        acc = self.seconds.get(st.key)
        if acc is not None and acc.start != second:
            self._flush_second(st, acc)
            acc = None
        if acc is None:
            acc = self.seconds[st.key] = Second(second)
        led = st.ledger
        acc.steps += 1
        acc.scheduled += s.scheduled_tokens
        acc.budget += s.token_budget
        acc.sum_running += s.running
        if s.waiting > acc.max_waiting:
            acc.max_waiting = s.waiting
        if s.preemptions:
            acc.preemptions += len(s.preemptions)
        if led.synced:
            free = led.free
            if acc.min_free < 0 or free < acc.min_free:
                acc.min_free = free
            acc.sum_free += free
            acc.free_samples += 1
            used = led.usable_blocks - free  # led.used
            if used > acc.max_used:
                acc.max_used = used
            if acc.steps == 1 or s.preemptions:
                run = led.max_contiguous_free()
                acc.min_maxrun = run if acc.min_maxrun < 0 else min(acc.min_maxrun, run)

    def _flush_second(self, st: EngineState, acc: Second) -> None:
        self.emit(StepStat(
            ts=acc.start, model=st.hello.model, engine=st.engine, server=st.server, steps=acc.steps,
            scheduled_tokens=acc.scheduled, budget_tokens=acc.budget, min_free_blocks=acc.min_free,
            avg_free_blocks=acc.sum_free / acc.free_samples if acc.free_samples else -1.0,
            min_max_contiguous_free=acc.min_maxrun, max_used_blocks=acc.max_used,
            avg_running=acc.sum_running / acc.steps, max_waiting=acc.max_waiting,
            preemptions=acc.preemptions,
            tail_waste_tokens=st.ledger.tail_waste_tokens() if st.ledger.synced else -1))

    def flush(self, hub_engines: dict[str, EngineState]) -> None:
        """Emit the open per-second rollups (at shutdown)."""
        for engine, acc in list(self.seconds.items()):
            st = hub_engines.get(engine)
            if st is not None:
                self._flush_second(st, acc)
        self.seconds.clear()
