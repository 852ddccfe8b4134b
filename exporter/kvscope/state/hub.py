"""All engines the sidecar hears from, and the counts of what it refused.

``Hub.accept(parts)`` is the single entry for probe data: it validates the frame,
routes it to its probe session's engine state and never raises. One lock serialises
ingestion against readers (metrics, API).

Identity. An engine is (server, engine label) from its hello (``kvscope_probe.identity``);
``EngineState.key`` names it uniquely in this sidecar (``server/engine``, or the engine
label alone for an engine outside an API server). A new session under a key whose holder
is no longer connected is that engine restarted: it replaces the old state. A new session
under a key whose holder is still connected is a collision (two processes claim one
identity): both are kept, the newcomer's server label gets ``#<pid>``, and the collision is
counted and logged. Heartbeats keep a session connected; a heartbeat from a session the
sidecar has not met yet (the sidecar restarted while the engine idles) is kept as a
pending presence until the engine's next step brings its hello.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

from kvscope.state.engine import EngineState, Listener
from kvscope.state.presence import CONNECTED, Presence
from kvscope.throttle import worth_logging
from kvscope_probe import wire
from kvscope_probe.identity import engine_key

log = logging.getLogger("kvscope.sidecar")

MAX_PENDING = 256
"""Sessions heard only through heartbeats that the hub remembers."""
MAX_ENGINES = 4096
"""Engines the hub holds at most: a hello of one more (not a restart of an engine it
holds) is refused as ``too_many_engines``, so hellos with ever new identities cannot grow
the sidecar's memory without bound (a gone engine is forgotten after FORGET_GONE_S)."""
"""Sessions heard only through heartbeats that the hub remembers."""
FORGET_GONE_S = 3600.0
"""A gone (or silent) engine whose identity nobody reclaimed is dropped after this."""


class _Unknown(Exception):
    """Records of a probe session whose hello or keyframe has not arrived yet."""


class _Refused(Exception):
    """A frame refused before any of its records was applied: no state is touched (a
    refused frame of a known session leaves its ledger as it was)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


MAX_NUM_BLOCKS = 1 << 25
"""Most blocks a hello may declare: the ledger holds a byte per block (and the probe's
mirror, keyframes and layout snapshots as much), so a hello's pool is bounded before the
sidecar allocates for it. 32 Mi blocks of 16 tokens are 512 Mi tokens of KV cache."""
MAX_KV_GROUPS = 64
"""Most KV cache groups a hello may declare (a hybrid model has a handful)."""
MAX_DISABLED = 64
"""Most disabled features a hello may list (the probe has ten; unknown ones are exported
under ``feature="other"``)."""


def check_hello(hello: wire.Hello) -> None:
    """Refuse (``invalid``) a hello whose pool cannot exist: figures derived from it (the
    head's fit divides by block sizes) would fail at every scrape, for every engine."""
    problem = None
    if not 1 <= hello.num_blocks <= MAX_NUM_BLOCKS:
        problem = f"num_blocks {hello.num_blocks} outside 1..{MAX_NUM_BLOCKS}"
    elif hello.block_size < 1:
        problem = f"block_size {hello.block_size}"
    elif len(hello.kv_groups) > MAX_KV_GROUPS:
        problem = f"{len(hello.kv_groups)} KV groups (at most {MAX_KV_GROUPS})"
    elif len(hello.disabled) > MAX_DISABLED:
        problem = f"{len(hello.disabled)} disabled features (at most {MAX_DISABLED})"
    else:
        bad = [g.block_size for g in hello.kv_groups if g.block_size < 1]
        if bad:
            problem = f"KV group block_size {bad[0]}"
    if problem is not None:
        raise _Refused("invalid", f"hello of engine {hello.engine!r}: {problem}")


HORIZON_HEARD_TICKS = 60
"""Ticks (``tick``, at most one every ``receiver.TICK_S`` = 0.1 s: 6 s at least) without a
word from an engine after which the record horizon leaves it out: three of the probe's
heartbeat periods (``kvscope_probe.sender.HEARTBEAT_S``), and a live probe is heard at
least once a period, steps or not (its sender's own thread sends the heartbeat). Counted
in ticks, not seconds, so a sidecar whose ingest thread was descheduled for seconds reads
what waits in its queue before it gives up on an engine."""


class Hub:
    def __init__(self, *, health_timeout_s: float = 30.0) -> None:
        self.lock = threading.RLock()
        self.health_timeout_s = health_timeout_s
        self.engines: dict[str, EngineState] = {}
        """Engine key -> state."""
        self.sessions: dict[str, EngineState] = {}
        self.presence: dict[str, Presence] = {}
        """Session -> presence, for every known state."""
        self.pending: OrderedDict[str, Presence] = OrderedDict()
        self.ticks = 0
        """``tick`` calls so far: the horizon's clock (``HORIZON_HEARD_TICKS``)."""
        self.listeners: list[Listener] = []
        self.client_listeners: list[Callable[[wire.Record], None]] = []
        self.tick_listeners: list[Callable[[], None]] = []
        self.client_records = 0
        self.frames = 0
        self.records = 0
        self.heartbeats = 0
        self.rejected: Counter[str] = Counter()
        self.collisions: Counter[tuple[str, str]] = Counter()
        """(server, engine) claimed by a second live probe -> times."""
        self.started_monotonic = time.monotonic()
        self.last_record_monotonic: float | None = None

    def accept(self, parts: list[bytes]) -> bool:
        """Take one multipart message from a probe; False when it was rejected."""
        try:
            frame = wire.decode(parts)
        except wire.WireError as exc:
            self.refuse(exc.reason, str(exc))
            return False
        with self.lock:
            try:
                self._ingest(frame)
            except _Unknown:
                self.rejected["unknown_session"] += 1
                return False
            except _Refused as exc:
                self.refuse(exc.reason, str(exc))
                return False
            except Exception as exc:  # noqa: BLE001 - a bad frame must never stop the receiver
                state = self.sessions.get(frame.session)
                if state is not None:  # the frame's later records are lost: no gap says so
                    state.ledger.stale()
                    state.prev_cached = None  # nor what "the same list" refers to
                self.refuse("invalid", f"engine {frame.engine!r}: {exc}")
                return False
            self.frames += 1  # accepted: a refused frame is counted once, as rejected
        return True

    def refuse(self, reason: str, detail: str) -> None:
        """Count a refused frame (logged on ``worth_logging``'s schedule per reason)."""
        self.rejected[reason] += 1
        if worth_logging(self.rejected[reason]):
            log.warning("rejected probe frame (%s, %d so far): %s",
                        reason, self.rejected[reason], detail[:300])

    def _ingest(self, frame: wire.Frame) -> None:
        if frame.engine.startswith(wire.CLIENT_ENGINE_PREFIX):
            for rec in frame.records:
                if not isinstance(rec, (wire.ClientStart, wire.ClientEnd)):
                    raise ValueError("engine records in a middleware frame")
                for fn in self.client_listeners:
                    fn(rec)
            self.client_records += len(frame.records)
            return
        beats = sum(isinstance(r, wire.Heartbeat) for r in frame.records)
        if beats and beats == len(frame.records):
            self._heartbeat(frame)
            return
        if beats:
            raise ValueError("heartbeats among records (they travel alone)")
        state = self.sessions.get(frame.session)
        if state is None:
            hello = next(
                (r if isinstance(r, wire.Hello) else r.hello
                 for r in frame.records if isinstance(r, (wire.Hello, wire.Keyframe))),
                None,
            )
            if hello is None:
                raise _Unknown()
            if hello.session != frame.session or hello.engine != frame.engine:
                raise ValueError("hello does not match the frame's engine and session")
            state = self._admit(hello, frame.first_seq)
        elif state.hello.engine != frame.engine:  # not that session's: leave it be
            raise _Refused("invalid", f"engine {frame.engine!r}: frame's engine differs "
                           "from its session's hello")
        elif frame.first_seq < state.next_seq:  # records it has applied: a replay
            raise _Refused("invalid", f"engine {frame.engine!r}: frame of records "
                           f"{frame.first_seq}.. replayed (next is {state.next_seq})")
        state.note_frame(frame)
        for rec in frame.records:
            state.ingest(rec)
        self.records += len(frame.records)
        presence = self.presence[frame.session]
        presence.heard(step=True)
        presence.heard_tick = self.ticks
        if state.last_step is not None and state.last_step.ts > presence.record_ts:
            presence.record_ts = state.last_step.ts
        self.last_record_monotonic = time.monotonic()

    def _heartbeat(self, frame: wire.Frame) -> None:
        p = self.presence.get(frame.session) or self.pending.get(frame.session)
        if p is None:
            p = self.pending[frame.session] = Presence.of(frame.session, frame.engine)
            while len(self.pending) > MAX_PENDING:
                self.pending.popitem(last=False)
        elif p.engine != frame.engine:
            raise _Refused("invalid", f"engine {frame.engine!r}: heartbeat's engine differs "
                           "from its session's")
        hb = frame.records[-1]
        assert isinstance(hb, wire.Heartbeat)
        p.heard(step=False)
        p.heard_tick = self.ticks
        p.record_ts = max(p.record_ts, hb.ts)
        p.heartbeats += len(frame.records)
        p.since_step_s, p.unfinished = hb.since_step_s, hb.unfinished
        self.heartbeats += len(frame.records)
        state = self.sessions.get(frame.session)
        if state is not None:
            state.probe_dropped = frame.dropped
            if frame.faults > state.probe_faults:
                state.ledger.stale()  # the probe's mirror may be under repair
            state.probe_faults = frame.faults

    def _admit(self, hello: wire.Hello, first_seq: int) -> EngineState:
        """A state for a new probe session: a restart, a new engine or a collision."""
        check_hello(hello)
        server = hello.server
        key = engine_key(server, hello.engine)
        holder = self.engines.get(key)
        restart = holder is not None and self.state_of(holder) not in CONNECTED
        if holder is not None and not restart:  # a collision: kept apart
            server = self._free_server(hello)
            key = engine_key(server, hello.engine)
        if not restart and len(self.engines) >= MAX_ENGINES:
            raise _Refused("too_many_engines", f"hello of engine {hello.engine!r} (server "
                           f"{hello.server!r}): the sidecar holds {MAX_ENGINES} engines")
        if holder is not None and restart:
            log.info("engine %s: new probe session %s (engine restarted)", key, hello.session)
            self._forget(holder)
        elif holder is not None:
            n = self.collisions[(hello.server, hello.engine)] = (
                self.collisions[(hello.server, hello.engine)] + 1)
            if worth_logging(n):
                log.warning("two live probes claim server %r engine %r (pids %d and %d): "
                            "kept apart, the newer as server %r; give each vLLM server its "
                            "own KVSCOPE_SERVER (or KVSCOPE_ENGINE) [%d such so far]",
                            hello.server, hello.engine, holder.hello.pid, hello.pid, server, n)
        assert key not in self.engines  # a state is never replaced without _forget
        state = EngineState(hello, self.listeners)
        state.key, state.server = key, server
        state.next_seq = first_seq
        self.engines[key] = state
        self.sessions[hello.session] = state
        p = self.pending.pop(hello.session, None)
        fresh = Presence.of(hello.session, hello.engine, hello.pid, hello.started)
        if p is not None:
            fresh.heartbeats, fresh.since_step_s = p.heartbeats, p.since_step_s
            fresh.unfinished = p.unfinished
        fresh.heard_tick = self.ticks
        self.presence[hello.session] = fresh
        for fn in self.listeners:
            fn("hello", state, hello)
        return state

    def _free_server(self, hello: wire.Hello) -> str:
        """A server label for a colliding hello whose engine key nobody holds:
        ``server#pid``, else with the session's head, else with a number too."""
        server = f"{hello.server}#{hello.pid}"
        if engine_key(server, hello.engine) not in self.engines:
            return server
        server = f"{server}-{hello.session[:6]}"
        n = 2
        label = server
        while engine_key(label, hello.engine) in self.engines:
            label = f"{server}-{n}"
            n += 1
        return label

    def _forget(self, state: EngineState) -> None:
        """Drop an engine's state, and tell the listeners (``"forget"``), which drop
        what they hold for its key; a listener's failure is logged, never raised."""
        self.engines.pop(state.key, None)
        self.sessions.pop(state.hello.session, None)
        self.presence.pop(state.hello.session, None)
        for fn in self.listeners:
            try:
                fn("forget", state, None)
            except Exception:  # noqa: BLE001 - never stop the receiver
                log.exception("engine %s: a listener failed to forget it", state.key)

    def state_of(self, state: EngineState) -> str:
        """active, idle, silent or gone (kvscope.state.presence)."""
        return self.presence[state.hello.session].state(self.health_timeout_s)

    def tick(self) -> None:
        """Periodic work (about every 100 ms, from the ingest thread)."""
        with self.lock:
            self.ticks += 1
            self._expire()
            for fn in self.tick_listeners:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - never stop the receiver
                    log.exception("periodic task failed")

    def _expire(self) -> None:
        now = time.monotonic()
        for session, p in list(self.pending.items()):
            if now - p.last_heard > self.health_timeout_s:
                del self.pending[session]
        for state in list(self.engines.values()):
            if now - self.presence[state.hello.session].last_heard > FORGET_GONE_S:
                log.info("engine %s: forgotten after %.0f s without a word", state.key,
                         FORGET_GONE_S)
                self._forget(state)

    def record_horizon(self) -> float:
        """The wall time the records of every engine still talking have reached (their
        latest step's or heartbeat's; infinite with none): whatever an engine did before
        it, the sidecar has read. For ``ClientJoin``: an answer's row waits for it, its
        engine's end of the request may come after the middleware's answer.

        Talking: heard within the last ``HORIZON_HEARD_TICKS`` ticks and not known gone.
        An engine stalled, replayed or just exited holds rows back ~6 s at most, and no
        process is looked up (this runs at every tick while a row waits, on the ingest
        thread; a scrape's ``state_of`` marks a dead one gone)."""
        since = self.ticks - HORIZON_HEARD_TICKS
        return min((p.record_ts for p in self.presence.values()
                    if p.heard_tick >= since and not p.gone),
                   default=float("inf"))

    def seconds_since_record(self) -> float | None:
        if self.last_record_monotonic is None:
            return None
        return time.monotonic() - self.last_record_monotonic
