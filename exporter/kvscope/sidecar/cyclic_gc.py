"""How ``kvscope serve`` runs Python's cyclic garbage collector.

Nearly everything the sidecar allocates is freed by reference counting: a decoded frame's
lists, the rows on their way to the store. The cyclic collector runs on allocation counts
all the same, and with CPython's default thresholds (700, 10, 10) it ran once every ~13
engine steps at 256 running (a frame of ~23 steps decodes to ~1,600 tracked lists and
tuples at once, 2,312 at most in the recording), each collection walking whatever was
young then, every tenth one the older objects too: 10-14 µs of every ~100 µs ingested step
in a replay of that recording (benchmarks/README.md, issue 25).

``tune()`` freezes what start-up built (imported modules, pyarrow's pandas, the store's
client: a full collection would scan them each time) and lets ``GEN0_THRESHOLD`` net
allocations of tracked objects pass before a young collection, so a frame's burst is freed
by reference counting before any collection sees it. Never called inside vLLM: the probe
leaves the engine's collector as it is (``benchmarks/probe_gc.py``).
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000
"""Net allocations of container objects before a young collection (CPython: 700): several
times what one decoded frame holds at 256 running, so only what the sidecar keeps between
frames (rows waiting for the store, new requests' tables) sets it off: one young collection
in the recording's 6,050 steps against 441. Cyclic garbage (rare here) waits at most that
many allocations longer."""
OLDER_THRESHOLDS = (10, 10)
"""CPython's own for the two older generations: counted in young collections, which are
now rare."""


def tune() -> None:
    """Freeze the start-up heap and raise the young generation's threshold (once, as the
    sidecar starts serving)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *OLDER_THRESHOLDS)
