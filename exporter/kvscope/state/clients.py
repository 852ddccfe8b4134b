"""Layer 5: joins the middleware's client events to the engine's request traces.

Engine request IDs embed the request's own ID (the caller's ``X-Request-Id``, the body's
``request_id``, or the ``kvs<32 hex>`` the middleware set when neither was there): vLLM
0.32 forms ``cmpl-<id>-<i>-<8 hex>`` (completions; i = prompt index) and
``chatcmpl-<id>-<8 hex>`` (chat), with ``<k>_`` in front for each of n > 1 samples.
``caller_id`` parses that back exactly; joins use ``request_key`` of it, as the
middleware does. (vLLM's deprecated ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` drops the
8 hex digits; such traces do not join.)

A caller may reuse an ID. Start and end events pair on the middleware's ``call_id``; a
trace joins the one call of its key whose span (start to answer) holds the trace's
arrival, stamped by vLLM in the same API-server process. When that is not exactly one
call (concurrent requests under one ID; none, as for a call the middleware does not see)
the trace is written without client fields and counted unjoined: never guessed. A call is
kept until its answer (``MAX_OPEN_S`` at most) and ``keep_s`` after it.

Once a middleware has spoken, a trace whose start has not arrived waits up to
``join_wait_s``, then is written unjoined and counted; without one, traces go straight
out. An answered call's row waits until the records of every engine still talking have
passed the answer's time (``horizon``, the hub's: the engine ends a request before the API
server answers, but the probe's frames may reach the sidecar after the middleware's event),
``LATE_ROW_S`` more at most (an engine clock behind the API server's), and for its first
trace ``join_wait_s`` at most: a row written without its engine request left ``kvscope
explain`` answering 404 for the caller's ID, and one written at its first trace left out
the call's other engine requests (n > 1 samples) and their preemptions. Waits are
counted in the sidecar's own ticks (``tick``, ~10 a second from the ingest thread), each
worth at most ``MAX_TICK_S``: a sidecar that stalls (CPU-starved, its
ingest thread descheduled for seconds: 11 s measured on a loaded 2-core machine) gives
up on nothing while the records it waits for sit unread in its queue. Digests are keyed
(``hashkey.Keyer``) on arrival, before anything keeps them.
Labels for per-client metrics are bounded: the first ``max_clients`` distinct values get
a label, the rest share ``other``, and every value refused a label is counted.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvscope.rows import ClientRequest, RequestTrace
from kvscope.state.client_stats import ClientStats, LabelSlots, client_label
from kvscope.state.hashkey import Keyer
from kvscope_probe import wire
from kvscope_probe.middleware import request_key

_ENGINE_ID = re.compile(r"(?:\d+_)?(chatcmpl|cmpl)-(.*)-[0-9a-f]{8}", re.DOTALL)
MAX_PENDING = 100_000
MAX_SAME_KEY = 16
"""Starts kept per request ID; a busier ID is ambiguous anyway."""
MAX_OPEN_S = 86_400.0
"""How long a call without its answer is kept (its answer event lost: the API server
died). An answered one is kept ``keep_s`` after its answer, for late traces."""
LATE_ROW_S = 60.0
"""How much longer than ``join_wait_s`` an answered call's row waits for engines whose
records have not passed the answer's time: one whose clock lags the API server's (one that
stopped talking leaves the horizon sooner, ``hub.HORIZON_HEARD_TICKS``)."""
MAX_TICK_S = 1.0
"""The most one tick adds to the join's clock. Ticks come every ~0.1 s (0.6-0.8 s apart
when the machine is loaded); a longer gap is the sidecar stalled, not the records late."""


def caller_id(engine_request_id: str) -> str | None:
    """The request's own ID inside a vLLM engine request ID, if it has that form."""
    m = _ENGINE_ID.fullmatch(engine_request_id)
    if m is None:
        return None
    kind, inner = m.groups()
    if kind == "chatcmpl":
        return inner
    inner, dash, index = inner.rpartition("-")
    return inner if dash and index.isdigit() else None


@dataclass(eq=False)
class _Call:
    start: wire.ClientStart
    seen: float
    label: str
    prompt_hash: str
    api_key_hash: str
    duplicate_of: str = ""
    engine_ids: list[str] = field(default_factory=list)
    preemptions: int = 0
    reason: str = ""
    end: wire.ClientEnd | None = None
    row_written: bool = False

    def spans(self, ts: float) -> bool:
        return self.start.ts <= ts and (self.end is None or ts <= self.end.ts)


class ClientJoin:
    """Holds client calls, enriches traces, writes client_requests rows."""

    def __init__(self, emit: Callable[[Any], None], *, keyer: Keyer,
                 join_wait_s: float = 5.0, duplicate_window_s: float = 10.0,
                 max_clients: int = 50, max_user_agents: int = 20, keep_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic,
                 horizon: Callable[[], float] | None = None) -> None:
        self.emit = emit
        self.horizon = horizon
        """The wall time the records of every engine still talking have reached
        (``Hub.record_horizon``): an answered call's row waits for it to pass the answer,
        as the engine's end of the request comes before the answer but may reach the
        sidecar after it."""
        self.keyer = keyer
        self.join_wait_s = join_wait_s
        self.duplicate_window_s = duplicate_window_s
        self.keep_s = keep_s
        self.clock = clock
        self.calls: OrderedDict[str, _Call] = OrderedDict()  # by call_id, in start order
        self.open: OrderedDict[str, None] = OrderedDict()  # not answered, in start order
        self.answered: OrderedDict[str, float] = OrderedDict()  # clock at the answer
        self.by_key: dict[str, list[_Call]] = {}
        self.last_prompt: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self.held: list[tuple[float, str, RequestTrace]] = []
        self.rows_waiting: list[tuple[float, _Call]] = []
        self.middleware_seen = False
        self.stats = ClientStats(LabelSlots(max_clients), LabelSlots(max_user_agents))
        self.waited = 0.0
        """Seconds of the join's clock: time the sidecar spent ticking (see MAX_TICK_S)."""
        self._last_tick = clock()

    # -- from the middleware ----------------------------------------------------------
    def on_client(self, rec: wire.Record) -> None:
        self.middleware_seen = True
        if isinstance(rec, wire.ClientStart):
            self._start(rec)
        elif isinstance(rec, wire.ClientEnd):
            self._end(rec)

    def _start(self, s: wire.ClientStart) -> None:
        call_id = s.call_id or s.request_id
        if call_id in self.calls:  # a replayed event: the call is known already
            return
        api_key_hash = self.keyer("api_key", s.api_key_sha256)
        c = _Call(s, self.clock(), client_label(s.client_id, api_key_hash),
                  self.keyer("prompt", s.prompt_sha256), api_key_hash)
        key = (c.label, c.prompt_hash)
        prev = self.last_prompt.get(key)
        if c.prompt_hash and prev is not None and s.ts - prev[0] <= self.duplicate_window_s:
            c.duplicate_of = prev[1]
        self.last_prompt[key] = (s.ts, s.request_id)
        self.last_prompt.move_to_end(key)
        self.calls[call_id] = c
        self.open[call_id] = None
        same = self.by_key.setdefault(s.request_id, [])
        same.append(c)
        del same[:-MAX_SAME_KEY]
        while len(self.calls) > MAX_PENDING:
            self._forget(next(iter(self.calls)))
        while len(self.last_prompt) > MAX_PENDING:
            self.last_prompt.popitem(last=False)

    def _forget(self, call_id: str) -> None:
        c = self.calls.pop(call_id)
        self.open.pop(call_id, None)
        self.answered.pop(call_id, None)
        same = self.by_key.get(c.start.request_id, [])
        if c in same:
            same.remove(c)
        if not same:
            self.by_key.pop(c.start.request_id, None)

    def _end(self, e: wire.ClientEnd) -> None:
        call_id = e.call_id or e.request_id
        c = self.calls.get(call_id)
        if c is None or c.end is not None:
            return
        c.end = e
        self.open.pop(call_id, None)
        self.answered[call_id] = self.clock()
        if c.engine_ids and self._past_answer(c):
            self._write_row(c)
        else:  # the engine's trace usually lands just after the HTTP answer: wait for it
            self.rows_waiting.append((self.waited + self.join_wait_s, c))

    def _past_answer(self, c: _Call) -> bool:
        """Every engine still talking has sent its records up to the call's answer: each
        engine request of the call (n > 1 samples, a list of prompts: several) ended
        before the answer, so its trace has reached the join."""
        assert c.end is not None
        return self.horizon is None or c.end.ts <= self.horizon()

    def _write_row(self, c: _Call) -> None:
        e = c.end
        assert e is not None
        c.row_written = True
        s, st = c.start, self.stats
        label = st.clients(c.label)
        st.bump(st.requests, label)
        st.bump(st.agent_requests, st.agents(s.user_agent))
        if c.duplicate_of:
            st.bump(st.duplicates, label)
        self.emit(ClientRequest(
            ts=e.ts, request_id=s.request_id, engine_request_ids=",".join(c.engine_ids),
            model=s.model, endpoint=s.endpoint, client_id=s.client_id,
            user_agent=s.user_agent, api_key_hash=c.api_key_hash, prompt_hash=c.prompt_hash,
            prompt_chars=s.prompt_chars, max_tokens=s.max_tokens, http_status=e.status,
            duration_s=e.duration_s, duplicate=bool(c.duplicate_of),
            duplicate_of=c.duplicate_of, preempt_count=c.preemptions if c.engine_ids else -1,
            preempt_reason=c.reason, engine_ids=list(c.engine_ids)))

    # -- from the request tracker ---------------------------------------------------------
    def on_trace(self, trace: RequestTrace) -> None:
        """Enrich and emit a trace now, or hold it until its client event arrives."""
        rid = caller_id(trace.request_id) if self.middleware_seen else None
        if rid is None:  # no middleware, or not a request the middleware sees
            self.emit(trace)
            return
        key = request_key(rid)
        if not self._settle(key, trace):
            self.held.append((self.waited + self.join_wait_s, key, trace))
            if len(self.held) > MAX_PENDING:
                self._release(self.held.pop(0)[2])

    def _settle(self, key: str, trace: RequestTrace) -> bool:
        """Join the trace to its call, or write it unjoined when several calls could own
        it; False when no call of its key could (yet)."""
        spanning = [c for c in self.by_key.get(key, []) if c.spans(trace.arrival_ts)]
        if len(spanning) == 1:
            self._join(spanning[0], trace)
        elif spanning:
            self.stats.ambiguous_traces += 1
            self._release(trace)
        return bool(spanning)

    def _join(self, c: _Call, trace: RequestTrace) -> None:
        s, st = c.start, self.stats
        c.engine_ids.append(trace.request_id)
        c.preemptions += trace.preempt_count
        c.reason = trace.preempt_reason or c.reason
        label = st.clients(c.label, count=False)  # counted once, with the call's row
        agent = st.agents(s.user_agent, count=False)
        if trace.preempt_count:
            st.bump(st.preempted_requests, label)
            st.bump(st.preemptions, label, trace.preempt_count)
            st.bump(st.agent_preemptions, agent, trace.preempt_count)
        st.joined_traces += 1
        self.emit(replace(trace, client_id=s.client_id, user_agent=s.user_agent,
                          api_key_hash=c.api_key_hash, prompt_hash=c.prompt_hash))
        if c.end is not None and not c.row_written and self._past_answer(c):
            self._write_row(c)

    def _release(self, trace: RequestTrace) -> None:
        self.stats.unjoined_traces += 1
        self.emit(trace)

    def tick(self) -> None:
        """Retry held traces; release those past their wait; forget stale calls."""
        now = self.clock()
        self.waited += min(max(now - self._last_tick, 0.0), MAX_TICK_S)
        self._last_tick = now
        waited = self.waited
        held, self.held = self.held, []
        for deadline, key, trace in held:
            if self._settle(key, trace):
                continue
            if waited >= deadline:
                self._release(trace)
            else:
                self.held.append((deadline, key, trace))
        waiting, self.rows_waiting = self.rows_waiting, []
        horizon = self.horizon() if self.horizon is not None and waiting else float("inf")
        for deadline, c in waiting:
            if c.row_written:
                continue
            assert c.end is not None
            if ((waited >= deadline or c.engine_ids)
                    and (c.end.ts <= horizon or waited >= deadline + LATE_ROW_S)):
                self._write_row(c)
            else:
                self.rows_waiting.append((deadline, c))
        while self.answered:
            call_id, answered = next(iter(self.answered.items()))
            if now - answered < self.keep_s:
                break
            self._forget(call_id)
        while self.open:
            call_id = next(iter(self.open))
            if now - self.calls[call_id].seen < MAX_OPEN_S:
                break
            self._forget(call_id)

    def flush(self) -> None:
        for _, _, trace in self.held:
            self._release(trace)
        self.held = []
        for _, c in self.rows_waiting:
            if not c.row_written:
                self._write_row(c)
        self.rows_waiting = []
