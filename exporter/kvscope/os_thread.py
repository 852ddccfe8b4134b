"""Each sidecar thread's name in the kernel, so its CPU can be read per thread.

CPython 3.11 names only the Python ``Thread`` object; the kernel sees every thread as
``python``. ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm`` (what
``benchmarks/sidecar_live.py`` sums CPU by) show the name set here instead: exact CPU
per thread, where a sampling profiler only sees who holds the GIL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_PR_SET_NAME = 15
_COMM_MAX = 15  # the kernel keeps 15 bytes and a NUL

try:
    _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
except (AttributeError, OSError):  # not Linux: names are a diagnostic, never required
    _prctl = None


def comm_name(name: str) -> bytes:
    """What the kernel keeps of ``name``: ASCII, without the ``kvscope-`` prefix every
    sidecar thread shares, at most 15 bytes."""
    short = name.removeprefix("kvscope-")
    return short.encode("ascii", "replace")[:_COMM_MAX]


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its Python name (or ``name``) in the kernel; never raises."""
    if _prctl is None:
        return
    try:
        _prctl(_PR_SET_NAME, comm_name(name or threading.current_thread().name), 0, 0, 0)
    except Exception:  # noqa: BLE001 - a name is not worth a failed thread
        pass
