"""LongestFreeRun recomputes only the chunks marked as changed: after every change its
answer must equal a scan of the whole pool, across chunk edges, whole free chunks and
resizes; and the ledger must mark every chunk its ops touch."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.state.free_run import CHUNK, SCAN_BELOW, LongestFreeRun
from kvscope.state.ledger import Ledger
from kvscope_probe import wire

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
@given(n=st.integers(0, 200), chunk=st.sampled_from([8, 16, 32, 64]),
       start=st.sampled_from([0, 2]), steps=changes)
def test_equals_a_scan_after_every_change(n: int, chunk: int, start: int,
                                          steps: list[list[tuple[int, int, int]]]) -> None:
    """In chunks, each change marked."""
    states = bytearray([start]) * n
    longest = LongestFreeRun(FREE_MAX, chunk)
    assert longest.measure(states) == scan(states)
    for step in steps:
        marked = 0
        for at, length, state in step:  # a range of blocks set to one state
            if n:
                at %= n
                end = min(n, at + length)
                states[at:end] = bytes([state]) * (end - at)
                marked |= longest.chunks_of(at, end - 1)
        assert longest.measure(states, marked) == scan(states)


def test_unmarked_chunks_are_not_read() -> None:
    """A change outside the marked chunks is not seen until its chunk is marked: what is
    not marked is not read."""
    states = bytearray(64)
    longest = LongestFreeRun(FREE_MAX, 16)
    assert longest.measure(states) == 64
    states[40] = 2
    assert longest.measure(states, 0) == 64
    assert longest.measure(states, longest.chunks_of(40, 40)) == 40


def test_a_run_across_whole_free_chunks() -> None:
    """A run from one chunk's tail through free chunks into the next one's head; then
    one block in the middle taken, and given back."""
    states = bytearray([2]) * 100
    states[5:90] = bytes(85)
    longest = LongestFreeRun(FREE_MAX, 16)
    assert longest.measure(states) == 85
    states[40] = 2
    assert longest.measure(states, longest.chunks_of(40, 40)) == 49
    states[40] = 1
    assert longest.measure(states, longest.chunks_of(40, 40)) == 85


def test_a_new_pool_size_starts_over() -> None:
    longest = LongestFreeRun(FREE_MAX, 8)
    assert longest.measure(bytes(20)) == 20
    assert longest.measure(bytes([2]) + bytes(40), 0) == 40  # every chunk read anyway
    assert longest.measure(b"") == 0


def test_chunk_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        LongestFreeRun(FREE_MAX, 24)


ledger_ops = st.lists(st.one_of(
    st.tuples(st.sampled_from([wire.OP_ALLOC, wire.OP_FREE, wire.OP_FREE_CACHED,
                               wire.OP_UNCACHE]),
              st.lists(st.integers(1, 3 * CHUNK - 1), min_size=1, max_size=6, unique=True)),
    st.tuples(st.sampled_from([wire.OP_ALLOC, wire.OP_FREE_CACHED]),
              st.integers(1, 3 * CHUNK - 200).map(lambda a: list(range(a, a + 150)))),
    st.just((wire.OP_UNCACHE_ALL, [])),
), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(ledger_ops, min_size=1, max_size=10),
       blocks=st.sampled_from([3 * CHUNK, SCAN_BELOW - 1]))
def test_the_ledger_marks_every_chunk_its_ops_touch(
        steps: list[list[tuple[int, list[int]]]], blocks: int) -> None:
    """Three chunks of blocks; after each step's ops the ledger's longest run equals a
    scan of its states (a chunk left unmarked would keep its figures from before). A pool
    under ``SCAN_BELOW`` is scanned whole, to the same answer."""
    led = Ledger(blocks, [16])
    assert led.max_contiguous_free() == scan(led.states)
    for ops in steps:
        led.apply([(kind, [1 + (i - 1) % (blocks - 1) for i in ids]) for kind, ids in ops])
        assert led.max_contiguous_free() == scan(led.states)
