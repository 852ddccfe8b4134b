"""LongestFreeRun recomputes only the chunks that changed: after every change its answer
must equal a scan of the whole pool, across chunk edges, whole free chunks and resizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.state.free_run import LongestFreeRun

FREE_MAX = 1  # states 0 (free) and 1 (cached) are free, as in the ledger


def scan(states: bytes | bytearray) -> int:
    """The longest run of free states, block by block."""
    best = run = 0
    for s in states:
        run = run + 1 if s <= FREE_MAX else 0
        best = max(best, run)
    return best


changes = st.lists(st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 40),
                                      st.sampled_from([0, 1, 2, 3])), max_size=4),
                   min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 200), chunk=st.sampled_from([8, 16, 24, 64]),
       start=st.sampled_from([0, 2]), steps=changes, whole=st.booleans())
def test_equals_a_scan_after_every_change(n: int, chunk: int, start: int,
                                          steps: list[list[tuple[int, int, int]]],
                                          whole: bool) -> None:
    """In chunks (``whole``: the pool scanned whole each time, as a small one is)."""
    states = bytearray([start]) * n
    longest = LongestFreeRun(FREE_MAX, chunk, scan_below=10**9 if whole else 0)
    assert longest.measure(states) == scan(states)
    for step in steps:
        for at, length, state in step:  # a range of blocks set to one state
            if n:
                at %= n
                states[at:at + length] = bytes([state]) * len(states[at:at + length])
        assert longest.measure(states) == scan(states)


def test_a_run_across_whole_free_chunks() -> None:
    """A run from one chunk's tail through free chunks into the next one's head; then
    one block in the middle taken, and given back."""
    states = bytearray([2]) * 100
    states[5:90] = bytes(85)
    longest = LongestFreeRun(FREE_MAX, 16, scan_below=0)
    assert longest.measure(states) == 85
    states[40] = 2
    assert longest.measure(states) == 49
    states[40] = 1
    assert longest.measure(states) == 85


def test_a_new_pool_size_starts_over() -> None:
    longest = LongestFreeRun(FREE_MAX, 8, scan_below=0)
    assert longest.measure(bytes(20)) == 20
    assert longest.measure(bytes([2]) + bytes(40)) == 40
    assert longest.measure(b"") == 0


def test_chunk_must_be_whole_words() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        LongestFreeRun(FREE_MAX, 12)


def test_a_small_pool_is_scanned_whole() -> None:
    """Below two chunks by default: no chunk is kept."""
    longest = LongestFreeRun(FREE_MAX, 8)
    assert longest.measure(bytes(15)) == 15 and longest._n == -1
    assert longest.measure(bytes(16)) == 16 and longest._n == 16
