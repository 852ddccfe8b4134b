"""The pool's longest run of free blocks, recomputed only where the pool changed.

A scan of the whole pool for its runs costs ~8 instructions a block: ~1 M a sample at
131,072 blocks, sampled ten times a second per engine, about half of what the sidecar's
hub did per step for a 32-running engine at 100 steps a second (benchmarks/README.md).
Between two samples a decoding engine touches a few hundred blocks, and vLLM hands out
blocks from the head of its free queue, so they fall in one or two places of the pool.

Here the pool is cut in chunks of ``chunk`` blocks, and each chunk keeps four figures of
its free blocks: the run it starts with, the run it ends with, its longest run, and
whether it is free throughout. A sample compares the states with the copy it kept
(eight blocks a word), recomputes the figures of the chunks that differ (all of them in
one pass), and joins the chunks' figures into the pool's longest run. Exact by
construction: any block whose state differs from the kept copy marks its chunk, and a
chunk's figures are a function of its blocks alone.
"""

from __future__ import annotations

import numpy as np

CHUNK = 4096
"""Blocks per chunk: 32 chunks at 131,072 blocks (a multiple of 8)."""

_NOT_FREE = 255  # the padding after the last block: never a free state


class LongestFreeRun:
    """The longest run of consecutive block IDs whose state is at most ``free_max``.

    A pool of fewer than ``scan_below`` blocks (two chunks by default) is scanned whole
    each time: keeping its chunks costs more numpy calls than the scan's passes save (a
    6,144-block pool that preempts every step read +45 k instructions a step)."""

    def __init__(self, free_max: int, chunk: int = CHUNK, scan_below: int | None = None
                 ) -> None:
        if chunk <= 0 or chunk % 8:
            raise ValueError(f"chunk must be a positive multiple of 8, not {chunk}")
        self.free_max = free_max
        self.chunk = chunk
        self.scan_below = 2 * chunk if scan_below is None else scan_below
        self._n = -1  # blocks of the pool measured last (-1: none yet)
        self._kept = np.zeros(0, np.uint8)  # its states, padded to whole chunks
        self._xor = np.zeros(0, np.uint64)  # scratch: _kept's words
        self._head: list[int] = []  # per chunk: the free run it starts with...
        self._tail: list[int] = []  # ... the one it ends with...
        self._best: list[int] = []  # ... and its longest (lists: joined in Python)

    def measure(self, states: bytes | bytearray | memoryview) -> int:
        """The longest free run of ``states`` (one byte per block)."""
        now = np.frombuffer(states, np.uint8)
        n = now.size
        if n < self.scan_below:
            return self._scan(now)
        if n != self._n:
            self._start(n)
            dirty = np.arange(len(self._head))
        else:
            dirty = self._changed(now)
        c = self.chunk
        kept = self._kept
        for i in dirty.tolist():  # a few chunks: copied one by one
            kept[i * c:min(n, i * c + c)] = now[i * c:i * c + c]
        if dirty.size:
            self._update(dirty)
        return self._join()

    def _scan(self, now: np.ndarray) -> int:
        """The whole pool's longest free run, in one pass."""
        free = np.zeros(now.size + 2, bool)
        np.less_equal(now, self.free_max, out=free[1:-1])
        edges = np.flatnonzero(free[1:] != free[:-1])  # a run's start, then its end
        return int((edges[1::2] - edges[0::2]).max(initial=0))

    def _changed(self, now: np.ndarray) -> np.ndarray:
        """The chunks where ``now`` differs from the kept states: eight blocks a word."""
        n = now.size
        w = n // 8 * 8
        x = self._xor
        np.bitwise_xor(now[:w].view(np.uint64), self._kept[:w].view(np.uint64),
                       out=x[:w // 8])
        if w < n:  # the last, partial word (x is padded to whole chunks)
            x[w // 8] = now[w:].tobytes() != self._kept[w:n].tobytes()
        words = x.reshape(len(self._head), self.chunk // 8)
        return np.flatnonzero(np.bitwise_or.reduce(words, axis=1))

    def _start(self, n: int) -> None:
        chunks = -(-n // self.chunk)
        self._n = n
        self._kept = np.full(chunks * self.chunk, _NOT_FREE, np.uint8)
        self._xor = np.zeros(chunks * self.chunk // 8, np.uint64)
        self._head = [0] * chunks
        self._tail = [0] * chunks
        self._best = [0] * chunks

    def _update(self, dirty: np.ndarray) -> None:
        """The figures of the chunks in ``dirty`` (sorted chunk numbers), in one pass."""
        c = self.chunk
        k = dirty.size
        free = np.zeros((k, c + 2), bool)  # each chunk's blocks, a non-free one either side
        np.less_equal(self._kept.reshape(-1, c)[dirty], self.free_max, out=free[:, 1:-1])
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
        for i, h, t, b in zip(dirty.tolist(), head.tolist(), tail.tolist(), best.tolist(),
                              strict=True):
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
