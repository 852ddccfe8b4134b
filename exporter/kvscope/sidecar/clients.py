"""Layer 5: joins the middleware's client events to the engine's request traces.

vLLM 0.32 turns the ``X-Request-Id`` the middleware sets (``kvs<32 hex>``) into engine
request IDs ``cmpl-<id>-<i>-<8 hex>`` (completions; i = prompt index) and
``chatcmpl-<id>-<8 hex>`` (chat). ``external_id`` recovers the middleware's ID from those.
A trace whose client event has not arrived yet waits up to ``join_wait_s``; then it is
written without client fields and counted as unjoined. Labels for per-client metrics are
bounded: the first ``max_clients`` distinct values get a label, the rest share ``other``,
and every value refused a label is counted.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvscope.sinks.rows import ClientRequest, RequestTrace
from kvscope_probe import wire

_ENGINE_ID = re.compile(r"^(?:chat)?cmpl-(kvs[0-9a-f]{32})(?:[-_]\d+)?-[0-9a-zA-Z]{8}$")
MAX_PENDING = 100_000


def external_id(engine_request_id: str) -> str | None:
    """The middleware's request ID inside a vLLM engine request ID, if there is one."""
    m = _ENGINE_ID.match(engine_request_id)
    return m.group(1) if m else None


def client_label(start: wire.ClientStart) -> str:
    if start.client_id:
        return start.client_id
    if start.api_key_hash:
        return f"key:{start.api_key_hash[:8]}"
    return "anonymous"


class LabelSlots:
    """At most ``limit`` distinct label values; the rest become ``other``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: set[str] = set()
        self.overflow = 0

    def __call__(self, value: str) -> str:
        value = "".join(ch for ch in value[:256] if ch.isprintable())[:64] or "empty"
        if value in self.values:
            return value
        if len(self.values) < self.limit:
            self.values.add(value)
            return value
        self.overflow += 1
        return "other"


@dataclass
class ClientStats:
    """Per-client and per-user-agent counters, labels bounded by LabelSlots."""

    clients: LabelSlots
    agents: LabelSlots
    requests: dict[str, int] = field(default_factory=dict)
    duplicates: dict[str, int] = field(default_factory=dict)
    preempted_requests: dict[str, int] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    agent_requests: dict[str, int] = field(default_factory=dict)
    agent_preemptions: dict[str, int] = field(default_factory=dict)
    unjoined_traces: int = 0
    joined_traces: int = 0

    @staticmethod
    def bump(d: dict[str, int], key: str, n: int = 1) -> None:
        d[key] = d.get(key, 0) + n


@dataclass
class _Open:
    start: wire.ClientStart
    seen: float
    duplicate_of: str = ""
    engine_ids: list[str] = field(default_factory=list)
    preemptions: int = 0
    reason: str = ""
    end: wire.ClientEnd | None = None
    row_written: bool = False


class ClientJoin:
    """Holds client starts, enriches traces, writes client_requests rows."""

    def __init__(self, emit: Callable[[Any], None], *, join_wait_s: float = 5.0,
                 duplicate_window_s: float = 10.0, max_clients: int = 50,
                 max_user_agents: int = 20, keep_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit
        self.join_wait_s = join_wait_s
        self.duplicate_window_s = duplicate_window_s
        self.keep_s = keep_s
        self.clock = clock
        self.open: OrderedDict[str, _Open] = OrderedDict()
        self.closed: OrderedDict[str, _Open] = OrderedDict()  # answered; late traces join
        self.last_prompt: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self.held: list[tuple[float, RequestTrace]] = []
        self.rows_waiting: list[tuple[float, _Open]] = []
        self.stats = ClientStats(LabelSlots(max_clients), LabelSlots(max_user_agents))

    # -- from the middleware ----------------------------------------------------------
    def on_client(self, rec: wire.Record) -> None:
        if isinstance(rec, wire.ClientStart):
            self._start(rec)
        elif isinstance(rec, wire.ClientEnd):
            self._end(rec)

    def _start(self, s: wire.ClientStart) -> None:
        o = _Open(s, self.clock())
        key = (client_label(s), s.prompt_hash)
        prev = self.last_prompt.get(key)
        if s.prompt_hash and prev is not None and s.ts - prev[0] <= self.duplicate_window_s:
            o.duplicate_of = prev[1]
        self.last_prompt[key] = (s.ts, s.request_id)
        self.last_prompt.move_to_end(key)
        self.open[s.request_id] = o
        while len(self.open) > MAX_PENDING:
            self.open.popitem(last=False)
        while len(self.last_prompt) > MAX_PENDING:
            self.last_prompt.popitem(last=False)

    def _end(self, e: wire.ClientEnd) -> None:
        o = self.open.pop(e.request_id, None)
        if o is None:
            return
        self.closed[e.request_id] = o
        while len(self.closed) > 10_000:
            self.closed.popitem(last=False)
        o.end = e
        if o.engine_ids:
            self._write_row(o)
        else:  # the engine's trace usually lands just after the HTTP answer: wait for it
            self.rows_waiting.append((self.clock() + self.join_wait_s, o))

    def _write_row(self, o: _Open) -> None:
        e = o.end
        assert e is not None
        o.row_written = True
        s, st = o.start, self.stats
        label = st.clients(client_label(s))
        st.bump(st.requests, label)
        st.bump(st.agent_requests, st.agents(s.user_agent))
        if o.duplicate_of:
            st.bump(st.duplicates, label)
        self.emit(ClientRequest(
            ts=e.ts, request_id=s.request_id, engine_request_ids=",".join(o.engine_ids),
            model=s.model, endpoint=s.endpoint, client_id=s.client_id,
            user_agent=s.user_agent, api_key_hash=s.api_key_hash, prompt_hash=s.prompt_hash,
            prompt_chars=s.prompt_chars, max_tokens=s.max_tokens, http_status=e.status,
            duration_s=e.duration_s, duplicate=bool(o.duplicate_of),
            duplicate_of=o.duplicate_of, preempt_count=o.preemptions if o.engine_ids else -1,
            preempt_reason=o.reason))

    # -- from the request tracker ---------------------------------------------------------
    def on_trace(self, trace: RequestTrace) -> None:
        """Enrich and emit a trace now, or hold it until its client event arrives."""
        ext = external_id(trace.request_id)
        if ext is None:
            self.emit(trace)
            return
        if not self._join(ext, trace):
            self.held.append((self.clock() + self.join_wait_s, trace))
            if len(self.held) > MAX_PENDING:
                self._release(self.held.pop(0)[1])

    def _join(self, ext: str, trace: RequestTrace) -> bool:
        o = self.open.get(ext) or self.closed.get(ext)
        if o is None:
            return False
        s, st = o.start, self.stats
        o.engine_ids.append(trace.request_id)
        o.preemptions += trace.preempt_count
        o.reason = trace.preempt_reason or o.reason
        label = st.clients(client_label(s))
        agent = st.agents(s.user_agent)
        if trace.preempt_count:
            st.bump(st.preempted_requests, label)
            st.bump(st.preemptions, label, trace.preempt_count)
            st.bump(st.agent_preemptions, agent, trace.preempt_count)
        st.joined_traces += 1
        self.emit(replace(trace, client_id=s.client_id, user_agent=s.user_agent,
                          api_key_hash=s.api_key_hash, prompt_hash=s.prompt_hash))
        if o.end is not None and not o.row_written:
            self._write_row(o)
        return True

    def _release(self, trace: RequestTrace) -> None:
        self.stats.unjoined_traces += 1
        self.emit(trace)

    def tick(self) -> None:
        """Retry held traces; release those past their wait; forget stale starts."""
        now = self.clock()
        still = []
        for deadline, trace in self.held:
            ext = external_id(trace.request_id)
            if ext is not None and self._join(ext, trace):
                continue
            if now >= deadline:
                self._release(trace)
            else:
                still.append((deadline, trace))
        self.held = still
        waiting = []
        for deadline, o in self.rows_waiting:
            if o.row_written:
                continue
            if now >= deadline:
                self._write_row(o)
            else:
                waiting.append((deadline, o))
        self.rows_waiting = waiting
        while self.open:
            first = next(iter(self.open.values()))
            if now - first.seen < self.keep_s:
                break
            self.open.popitem(last=False)

    def flush(self) -> None:
        for _, trace in self.held:
            self._release(trace)
        self.held = []
        for _, o in self.rows_waiting:
            if not o.row_written:
                self._write_row(o)
        self.rows_waiting = []
