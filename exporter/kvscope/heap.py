"""The sidecar's heap: buffers it frees are kept for reuse, not handed back to the kernel.

The sidecar builds sub-megabyte numpy buffers over a whole pool again and again: a layout
snapshot of a 131,072-block pool takes ~1 MB of them a second per engine (owner and group
per block, the states copied, their comparisons). glibc serves an allocation of 128 KiB or
more with its own ``mmap`` and gives the memory back when it is freed (or trims the heap's
top once more than twice that is free), so the next snapshot faults every page in again:
206 minor faults and ~340 µs of kernel time per snapshot, a third of its CPU, measured
(benchmarks/README.md). Above ``MMAP_THRESHOLD`` allocations still get their own
mapping, and the heap's free top is given back beyond ``TRIM_THRESHOLD``: what the
sidecar keeps beyond what it uses is bounded by that.

glibc only (``mallopt``); a process whose environment sets glibc's own variables
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) keeps them.
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 4 << 20
"""Allocations this large or larger get their own mapping (glibc's default: 128 KiB,
raised as large blocks are freed, at most 32 MiB)."""
TRIM_THRESHOLD = 32 << 20
"""Free memory at the heap's top beyond this is given back to the kernel."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_buffers() -> bool:
    """Set glibc's thresholds to the ones above; False where it did not (not glibc, set
    by the environment, or refused)."""
    if platform.libc_ver()[0] != "glibc" or any(v in os.environ for v in _GLIBC_VARIABLES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
