"""The sidecar's own CPU by thread, and its resident memory, for its own /metrics.

What kvscope costs the host it watches should not need a benchmark to see: an operator
adding it beside eight busy engines reads ``kvscope_sidecar_cpu_seconds_total`` by
``thread`` and divides by the engines' steps (the health row's "Sidecar CPU per engine
step" panel). Each sidecar thread names itself in the kernel (``kvscope.os_thread``), so
Linux counts CPU per thread exactly: ``/proc/self/task/<tid>/schedstat`` holds the
nanoseconds each thread has run, what ``benchmarks/sidecar_live.py`` sums.

Labels stay bounded by construction: a Python thread kvscope names is labelled with that
name when it is one of ``THREAD_LABELS`` (the kernel keeps 15 bytes: ``clickhouse-batc``),
the main thread (in ``kvscope serve``, the HTTP server's) ``main``, every other thread
``other``: the embedded ClickHouse's own (those the store's sending thread starts inherit
its name in the kernel, and are told apart by not being Python's), libzmq's, uvloop's.
Threads come and go (a store reconnect, a thread pool); each one's CPU is added to its
label as it grows, so the counters never go back when a thread ends: only what a thread
ran between the last scrape and its end is missed. Off Linux (no ``/proc``) nothing is
exported.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

from kvscope.os_thread import comm_name


def _kernel(name: str) -> str:
    """What ``/proc`` shows of a thread named ``name`` by ``kvscope.os_thread``."""
    return comm_name(name).decode("ascii")


MAIN = "main"
OTHER = "other"
THREAD_LABELS: tuple[str, ...] = (
    "receiver", "ingest", "layout", "http", "decision-log", "vllm-scraper",
    *(_kernel(f"{sink}-{loop}") for sink in ("clickhouse", "loki") for loop in ("batch", "send")),
    MAIN, OTHER,
)
"""Every ``thread`` label: the sidecar's named threads (``kvscope.os_thread``), main, other."""
_NAMED = frozenset(THREAD_LABELS) - {MAIN, OTHER}


def thread_cpu_ns(proc: Path) -> dict[int, tuple[str, int]]:
    """Each thread of the process whose ``/proc`` directory is ``proc``: its kernel name
    and the nanoseconds it has run (``schedstat``); empty where that cannot be read."""
    out: dict[int, tuple[str, int]] = {}
    try:
        tasks = list((proc / "task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            comm = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
            out[int(task.name)] = (comm, ns)
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return out


class OwnCpu:
    """CPU seconds of this process's threads, by bounded label, never decreasing."""

    def __init__(self, proc: str = "/proc/self") -> None:
        self.proc = Path(proc)
        self._lock = threading.Lock()  # two scrapes at once add each growth once
        self._seen: dict[int, int] = {}
        """Nanoseconds each live thread had run at the last reading, by thread ID."""
        self._totals: Counter[str] = Counter()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds by label so far (empty where ``/proc`` cannot be read)."""
        now = thread_cpu_ns(self.proc)
        with self._lock:
            python = {t.native_id for t in threading.enumerate()}
            pid = self._pid()
            seen: dict[int, int] = {}
            for tid, (comm, ns) in now.items():
                before = self._seen.get(tid, 0)
                if ns < before:  # the ID of an ended thread, taken by a new one
                    before = 0
                label = (MAIN if tid == pid
                         else comm if tid in python and comm in _NAMED else OTHER)
                self._totals[label] += ns - before
                seen[tid] = ns
            self._seen = seen
            return {k: v / 1e9 for k, v in self._totals.items()}

    def resident_bytes(self) -> int | None:
        """Resident memory of the process (None where ``/proc`` cannot be read)."""
        try:
            pages = int((self.proc / "statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return pages * os.sysconf("SC_PAGE_SIZE")

    def _pid(self) -> int:
        """The ID of the process ``proc`` is the directory of (its main thread's)."""
        try:
            return int(self.proc.resolve().name)
        except (OSError, ValueError):
            return os.getpid()
