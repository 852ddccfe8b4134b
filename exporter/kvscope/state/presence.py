"""Whether each probe is there: active, idle, silent or gone.

- ``active``: a step record arrived within the health timeout;
- ``idle``: only heartbeats did (the engine has nothing to schedule; healthy);
- ``silent``: nothing arrived within the health timeout, and the engine process is alive
  or cannot be checked: the probe (or its path to the sidecar) stopped;
- ``gone``: the engine process no longer exists. Checked by PID, only where the sidecar
  sees that very process (same host and PID namespace: the PID's start time equals the
  one in the engine's hello); elsewhere a dead engine reads ``silent`` after the timeout.

Connected means ``active`` or ``idle``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

STATES = ("active", "idle", "silent", "gone")
CONNECTED = ("active", "idle")
START_TIME_TOLERANCE_S = 1.0
"""/proc start times have clock-tick resolution; both sides compute them the same way."""


def sees_process(pid: int, started: float) -> bool:
    """Whether this host's ``pid`` is the process that started at ``started``."""
    if started <= 0:
        return False
    try:
        return abs(psutil.Process(pid).create_time() - started) <= START_TIME_TOLERANCE_S
    except (psutil.Error, OSError):
        return False


def process_gone(pid: int, started: float) -> bool:
    """Whether the process known by (pid, start time) has exited (zombies included)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) > START_TIME_TOLERANCE_S:
            return True  # the PID was reused
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except (psutil.Error, OSError):
        return False


@dataclass
class Presence:
    """What the sidecar heard from one probe session, and when (sidecar monotonic time)."""

    session: str
    engine: str
    pid: int = 0
    started: float = 0.0
    local: bool = False
    """The sidecar sees the engine process itself (so it may judge it gone by PID)."""
    last_heard: float = 0.0
    heard_tick: int = 0
    """The hub's tick count when last heard (``Hub.record_horizon``)."""
    last_step: float | None = None
    heartbeats: int = 0
    since_step_s: float = -1.0
    """From the last heartbeat: seconds since the engine's last schedule() call."""
    unfinished: int = -1
    """From the last heartbeat: vLLM's own count of unfinished requests (-1 unknown)."""
    record_ts: float = 0.0
    """The engine's wall time in its latest step or heartbeat (records arrive in order)."""
    gone: bool = False

    @classmethod
    def of(cls, session: str, engine: str, pid: int = 0, started: float = 0.0) -> Presence:
        return cls(session, engine, pid, started, local=sees_process(pid, started),
                   last_heard=time.monotonic())

    def heard(self, *, step: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_heard = now
        if step:
            self.last_step = now

    def state(self, timeout_s: float, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        if not self.gone and self.local and process_gone(self.pid, self.started):
            self.gone = True
        if self.gone:
            return "gone"
        if now - self.last_heard > timeout_s:
            return "silent"
        if self.last_step is not None and now - self.last_step <= timeout_s:
            return "active"
        return "idle"

    def as_json(self, timeout_s: float, now: float | None = None) -> dict[str, object]:
        now = time.monotonic() if now is None else now
        return {
            "state": self.state(timeout_s, now),
            "seconds_since_heard": round(now - self.last_heard, 3),
            "seconds_since_step": (None if self.last_step is None
                                   else round(now - self.last_step, 3)),
            "heartbeats": self.heartbeats,
            "pid_checked": self.local,
        }
