"""All engines the sidecar hears from, and the counts of what it refused.

``Hub.accept(parts)`` is the single entry for probe data: it validates the frame,
routes it to the engine's state (a new probe session replaces the old state) and never
raises. One lock serialises ingestion against readers (metrics, API).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvscope.sidecar.engine import EngineState, Listener
from kvscope_probe import wire

log = logging.getLogger("kvscope.sidecar")


class _Unknown(Exception):
    """Records of a probe session whose hello or keyframe has not arrived yet."""


class Hub:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.engines: dict[str, EngineState] = {}
        self.listeners: list[Listener] = []
        self.client_listeners: list[Callable[[wire.Record], None]] = []
        self.tick_listeners: list[Callable[[], None]] = []
        self.client_records = 0
        self.frames = 0
        self.records = 0
        self.rejected: Counter[str] = Counter()
        self.started_monotonic = time.monotonic()
        self.last_record_monotonic: float | None = None

    def accept(self, parts: list[bytes]) -> bool:
        """Take one multipart message from a probe; False when it was rejected."""
        try:
            frame = wire.decode(parts)
        except wire.WireError as exc:
            self._reject(exc.reason, str(exc))
            return False
        with self.lock:
            try:
                self._ingest(frame)
            except _Unknown:
                self.rejected["unknown_session"] += 1
                return False
            except Exception as exc:  # noqa: BLE001 - a bad frame must never stop the receiver
                state = self.engines.get(frame.engine)
                if state is not None:
                    state.ledger.synced = False
                self._reject("invalid", f"engine {frame.engine!r}: {exc}")
                return False
            self.frames += 1  # accepted: a refused frame is counted once, as rejected
        return True

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        if self.rejected[reason] in (1, 10, 100, 1000) or self.rejected[reason] % 10000 == 0:
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
        state = self.engines.get(frame.engine)
        if state is None or state.hello.session != frame.session:
            hello = next(
                (r if isinstance(r, wire.Hello) else r.hello
                 for r in frame.records if isinstance(r, (wire.Hello, wire.Keyframe))),
                None,
            )
            if hello is None:
                raise _Unknown()
            if hello.session != frame.session or hello.engine != frame.engine:
                raise ValueError("hello does not match the frame's engine and session")
            if state is not None:
                log.info("engine %s: new probe session %s (engine restarted)",
                         frame.engine, frame.session)
            state = EngineState(hello, self.listeners)
            state.next_seq = frame.first_seq
            self.engines[frame.engine] = state
            for fn in self.listeners:
                fn("hello", state, hello)
        state.note_frame(frame)
        for rec in frame.records:
            state.ingest(rec)
        self.records += len(frame.records)
        self.last_record_monotonic = time.monotonic()

    def tick(self) -> None:
        """Periodic work (about every 100 ms, from the receiver thread)."""
        with self.lock:
            for fn in self.tick_listeners:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - never stop the receiver
                    log.exception("periodic task failed")

    def seconds_since_record(self) -> float | None:
        if self.last_record_monotonic is None:
            return None
        return time.monotonic() - self.last_record_monotonic
