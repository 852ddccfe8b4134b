"""kvscope.heap: a pool-sized buffer freed and allocated again is not faulted in again.

Each case runs in a fresh interpreter (glibc's thresholds are per process and move as
large blocks are freed): a layout snapshot's pattern of buffers (~1 MB over a 131,072-block
pool) allocated, touched and freed 40 times, counting the minor page faults of the last 30.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from kvscope import heap

CYCLES = """
import resource, sys
import numpy as np
from kvscope.heap import keep_freed_buffers
tuned = keep_freed_buffers() if sys.argv[1] == "tuned" else False
def cycle():
    owner = np.full(131072, -1, np.int32)
    group = np.full(131072, 0, np.int16)
    states = bytes(131072)
    cut = np.frombuffer(states, np.uint8)[1:] != np.frombuffer(states, np.uint8)[:-1]
    return int(owner[7]) + int(group[7]) + int(cut.sum())
for _ in range(10):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    cycle()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def faults(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", CYCLES, mode], env={**clean, **env},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1])


@glibc
def test_buffers_freed_are_reused_without_faults() -> None:
    tuned, tuned_faults = faults("tuned")
    _, default_faults = faults("default")
    assert tuned == "True"
    # glibc's defaults hand ~1 MB back and fault it in again every cycle (~230 pages)
    assert default_faults >= 30 * 100, default_faults
    assert tuned_faults < 30, tuned_faults  # not one page a cycle


@glibc
def test_the_environment_keeps_its_own_thresholds() -> None:
    tuned, _ = faults("tuned", MALLOC_TRIM_THRESHOLD_="1000000")
    assert tuned == "False"


def test_thresholds_bound_what_is_kept() -> None:
    assert 128 << 10 < heap.MMAP_THRESHOLD <= heap.TRIM_THRESHOLD <= 64 << 20
