"""CPU time and resident memory of an engine process, when it runs on this host."""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessSample:
    cpu_seconds: float
    rss_bytes: int


class ProcessReader:
    """Caches one psutil handle per PID; a PID that vanished or belongs to another
    host's namespace simply yields no sample."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pid: int) -> ProcessSample | None:
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            with proc.oneshot():
                t = proc.cpu_times()
                return ProcessSample(t.user + t.system, proc.memory_info().rss)
        except (psutil.Error, OSError):
            self._procs.pop(pid, None)
            return None
