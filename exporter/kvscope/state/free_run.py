"""The pool's longest run of free blocks, recomputed only where the pool changed.

The longest free run is sampled ten times a second per engine. Scanning the whole pool
for it reads every block's state: 131,072 bytes at 131,072 blocks, from memory the
engine's other work has long evicted, and in the live sidecar that sample was a fifth of
the ingest thread's busy time for the fleet shape (8 engines x 131,072 blocks, 32
running; py-spy, benchmarks/README.md). Between two samples a decoding engine changes a
few hundred blocks, and vLLM hands out blocks from the head of its free queue, so they
fall in one or two places of the pool.

Here the pool is cut in chunks of ``chunk`` blocks, and each chunk keeps four figures of
its free blocks: the run it starts with, the run it ends with, its longest run, and
whether it is free throughout. The writer of the states (``Ledger``) marks the chunks of
the blocks it changes, a bit per chunk (``chunks_of``), and hands the marks to
``measure``, which recomputes those chunks' figures (all of them in one pass) and joins
the chunks' figures into the pool's longest run. Unmarked chunks are not read.

For a pool of fewer than ``SCAN_BELOW`` blocks the ledger scans the whole pool instead
(``Ledger.free_runs``): the chunks' numpy calls cost more than they save there.
"""

from __future__ import annotations

import numpy as np

CHUNK = 4096
"""Blocks per chunk: 32 chunks at 131,072 blocks (a power of two)."""
ALL = -1
"""Every chunk marked (a new pool, a keyframe, every cached block freed at once)."""
SCAN_BELOW = 2 * CHUNK
"""Pools smaller than this are scanned whole (a 6,144-block pool that preempts every step
read +45 k instructions a step in chunks)."""


def free_run_lengths(states: bytes | bytearray, free_max: int) -> np.ndarray:
    """Lengths of the maximal runs of consecutive block IDs whose state is at most
    ``free_max``, in block order (one pass over every block)."""
    free = np.zeros(len(states) + 2, dtype=bool)
    np.less_equal(np.frombuffer(states, np.uint8), free_max, out=free[1:-1])
    edges = np.flatnonzero(free[1:] != free[:-1])  # run starts and ends, alternating
    return edges[1::2] - edges[0::2]


class LongestFreeRun:
    """The longest run of consecutive block IDs whose state is at most ``free_max``."""

    def __init__(self, free_max: int, chunk: int = CHUNK) -> None:
        if chunk <= 0 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two, not {chunk}")
        self.free_max = free_max
        self.chunk = chunk
        self.shift = chunk.bit_length() - 1
        """A block's chunk is ``block >> shift``."""
        self._n = -1  # blocks of the pool measured last (-1: none yet)
        self._head: list[int] = []  # per chunk: the free run it starts with...
        self._tail: list[int] = []  # ... the one it ends with...
        self._best: list[int] = []  # ... and its longest (lists: joined in Python)

    def chunks_of(self, first: int, last: int) -> int:
        """The marks of the chunks from block ``first``'s to block ``last``'s."""
        return (2 << (last >> self.shift)) - (1 << (first >> self.shift))

    def measure(self, states: bytes | bytearray | memoryview, marked: int = ALL) -> int:
        """The longest free run of ``states`` (one byte per block), given the chunks
        ``marked`` since the last call (``chunks_of``, or'ed; ``ALL``): every block
        changed since must be in one of them."""
        now = np.frombuffer(states, np.uint8)
        n = now.size
        if n != self._n:
            self._start(n)
            marked = ALL
        chunks = len(self._head)
        if marked < 0:
            marked = (1 << chunks) - 1
        else:
            marked &= (1 << chunks) - 1
        if marked:
            self._update(now, marked)
        return self._join()

    def _start(self, n: int) -> None:
        chunks = -(-n // self.chunk)
        self._n = n
        self._head = [0] * chunks
        self._tail = [0] * chunks
        self._best = [0] * chunks

    def _update(self, now: np.ndarray, marked: int) -> None:
        """The figures of the ``marked`` chunks, in one pass over their blocks."""
        c = self.chunk
        rows = []
        while marked:  # the set bits, lowest first
            low = marked & -marked
            rows.append(low.bit_length() - 1)
            marked ^= low
        k = len(rows)
        free = np.zeros((k, c + 2), bool)  # each chunk's blocks, a non-free one either side
        for j, i in enumerate(rows):  # the last chunk may be short: the rest stays False
            blocks = now[i * c:i * c + c]
            np.less_equal(blocks, self.free_max, out=free[j, 1:1 + blocks.size])
        flat = free.ravel()
        edges = np.flatnonzero(flat[1:] != flat[:-1])  # a run's start, then its end
        starts, ends = edges[0::2], edges[1::2]
        row = starts // (c + 2)
        lengths = ends - starts
        first = starts - row * (c + 2) == 0  # the run starts at the chunk's first block
        last = ends - row * (c + 2) == c  # ... ends at its last
        head = np.zeros(k, np.int64)
        tail = np.zeros(k, np.int64)
        best = np.zeros(k, np.int64)
        head[row[first]] = lengths[first]
        tail[row[last]] = lengths[last]
        np.maximum.at(best, row, lengths)
        for i, h, t, b in zip(rows, head.tolist(), tail.tolist(), best.tolist(), strict=True):
            self._head[i], self._tail[i], self._best[i] = h, t, b

    def _join(self) -> int:
        """The pool's longest run from the chunks' figures: inside a chunk, or the end of
        one, the chunks free throughout after it, and the start of the next."""
        c = self.chunk
        longest = run = 0  # run: the free run that ends at the previous chunk's end
        for head, tail, best in zip(self._head, self._tail, self._best, strict=True):
            if head == c:  # free throughout: the run goes on
                run += c
                continue
            if run + head > longest:
                longest = run + head
            if best > longest:
                longest = best
            run = tail
        return max(longest, run)
