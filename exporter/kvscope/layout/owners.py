"""Which running request owns each block, and each owner's table figures, for a snapshot.

Computed over every table at once: the tables are flattened into one array in listing
order (request by request, group by group), so the per-block work is a few numpy passes
instead of a Python loop per request and block. The answer is that of reading the tables
one after another: a block belongs to the first table that lists it, and with several KV
groups its group is the last one that lists it. A block two requests list (a prefix-cache
hit: vLLM's ``touch`` raised its ref count) counts as shared for each of them, the first
included: freeing either frees none of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain

import numpy as np


def flatten(tables: Mapping[str, list[list[int]]]) -> FlatTables:
    """Every table's IDs in one array, in listing order (a copy: the tables may change)."""
    seg_lens = [len(ids) for t in tables.values() for ids in t]
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(tables.values())), np.int64,
                       sum(seg_lens))
    return FlatTables(flat, seg_lens, [len(t) for t in tables.values()])


def owner_figures(tables: Mapping[str, list[list[int]]] | FlatTables, n: int, owner: np.ndarray,
                  group: np.ndarray | None, dense: bool | None = None
                  ) -> tuple[list[int], list[int], list[int], FlatTables, np.ndarray]:
    """Fill ``owner`` (index of the request in ``tables``' order, per block) and, when
    given, ``group``; return per request its blocks (in the pool, null excluded), shared
    blocks (also listed by another request) and fragments (``snapshot.fragments`` of each
    group, summed); the tables flattened (``FlatTables``, or ``tables`` itself when
    flattened already: each group's runs, ``snapshot.table_runs``, are built from them
    when read); and the IDs of the blocks it filled, sorted. ``dense``: which way
    ``first_listings`` goes (None: the cheaper for these sizes)."""
    flat_tables = tables if isinstance(tables, FlatTables) else flatten(tables)
    flat, seg_lens = flat_tables.flat, flat_tables.seg_lens
    groups = np.asarray(flat_tables.groups, np.int64)
    nreq = groups.size
    seg_req = np.repeat(np.arange(nreq), groups)
    seg_group = np.arange(len(seg_lens)) - np.repeat(np.cumsum(groups) - groups, groups)
    seg_of = np.repeat(np.arange(len(seg_lens)), seg_lens)
    req_of = seg_req[seg_of]
    valid = (flat > 0) & (flat < n)
    v, vseg, vreq = flat[valid], seg_of[valid], req_of[valid]
    dense = dense_is_cheaper(v.size, n) if dense is None else dense
    blocks, first, _ = first_listings(v, n, dense)
    owner[blocks] = vreq[first]
    last = last_listings(v, n, blocks, dense)
    if group is not None and v.size:
        group[blocks] = seg_group[vseg[last]]
    shared_block = vreq[first] != vreq[last]  # a block's first and last listers differ
    if dense:
        by_id = np.zeros(n, bool)
        by_id[blocks] = shared_block
        shared = by_id[v]
    else:
        shared = shared_block[np.searchsorted(blocks, v)]
    pos = flat > 0
    p, pseg = flat[pos], seg_of[pos]
    new_frag = np.ones(p.size, bool)
    new_frag[1:] = (p[1:] != p[:-1] + 1) | (pseg[1:] != pseg[:-1])
    return (np.bincount(vreq, minlength=nreq).tolist(),
            np.bincount(vreq, weights=shared, minlength=nreq).astype(np.int64).tolist(),
            np.bincount(req_of[pos], weights=new_frag, minlength=nreq).astype(np.int64)
            .tolist(),
            flat_tables, blocks)


def dense_is_cheaper(listings: int, n: int) -> bool:
    """Whether scattering over a pool of ``n`` blocks costs less than sorting its
    ``listings``: at 256 running in 32,768 blocks (10,844 listings) the sort and a
    searchsorted took 1.3 ms of a 2.5 ms sample and the scatter 0.07; at 32 running in
    131,072 blocks (1,504) the sort 30 µs and the scatter's two pool-sized buffers 0.4 ms
    of page faults a sample (benchmarks/README.md, fourteenth pass)."""
    return listings * max(listings.bit_length(), 1) > n


def first_listings(v: np.ndarray, n: int, dense: bool | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For block IDs ``v`` (each in ``[0, n)``) listed in this order: the distinct IDs,
    sorted; the index in ``v`` of each one's first listing; and for each listing, the
    index of its block's first listing."""
    if (dense_is_cheaper(v.size, n) if dense is None else dense):
        first_at = np.full(n, v.size, np.int32)  # per block of the pool; v.size: unlisted
        np.minimum.at(first_at, v, np.arange(v.size, dtype=np.int32))
        blocks = np.flatnonzero(first_at < v.size)
        return blocks, first_at[blocks], first_at[v]
    blocks, first = np.unique(v, return_index=True)
    return blocks, first, first[np.searchsorted(blocks, v)]


def last_listings(v: np.ndarray, n: int, blocks: np.ndarray, dense: bool | None = None
                  ) -> np.ndarray:
    """The index in ``v`` of the last listing of each of ``blocks`` (``v``'s distinct IDs,
    sorted, as ``first_listings`` gives them)."""
    if (dense_is_cheaper(v.size, n) if dense is None else dense):
        last_at = np.full(n, -1, np.int32)
        np.maximum.at(last_at, v, np.arange(v.size, dtype=np.int32))
        return last_at[blocks]
    _, last = np.unique(v[::-1], return_index=True)
    return v.size - 1 - last


class FlatTables:
    """Every request's block table, group by group, flattened in listing order. A
    snapshot keeps this rather than its owners' runs: the runs are read only when the
    snapshot is shown or stored, and built per block table they were most of a busy
    pool's sample (at 256 running nearly every run is one block long)."""

    __slots__ = ("flat", "seg_lens", "groups")

    def __init__(self, flat: np.ndarray, seg_lens: list[int], groups: list[int]) -> None:
        self.flat = flat
        """Every table's IDs, request by request, group by group."""
        self.seg_lens = seg_lens
        """Each table's length, in the same order."""
        self.groups = groups
        """Each request's number of tables (KV cache groups)."""

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes + 8 * (len(self.seg_lens) + len(self.groups))

    def runs(self) -> list[list[tuple[tuple[int, int], ...]]]:
        """Each request's table runs per group: consecutive IDs, or consecutive null
        placeholders (0)."""
        flat, seg_lens = self.flat, self.seg_lens
        if flat.size and int(flat.min()) < 0:  # never from vLLM; the reference loop decides
            return [self.runs_of(i) for i in range(len(self.groups))]
        seg_of = np.repeat(np.arange(len(seg_lens)), seg_lens)
        start = np.ones(flat.size, bool)
        cur, prev = flat[1:], flat[:-1]
        same = ((cur == 0) & (prev == 0)) | ((cur > 0) & (prev > 0) & (cur == prev + 1))
        start[1:] = ~same | (seg_of[1:] != seg_of[:-1])
        at = np.flatnonzero(start)
        lengths = np.diff(np.append(at, flat.size)).tolist()
        runs = list(zip(flat[at].tolist(), lengths, strict=True))
        per_seg = np.bincount(seg_of[at], minlength=len(seg_lens)).tolist()
        out: list[list[tuple[tuple[int, int], ...]]] = []
        k = s = 0
        for n in self.groups:
            groups = []
            for _ in range(n):
                groups.append(tuple(runs[k:k + per_seg[s]]))
                k += per_seg[s]
                s += 1
            out.append(groups)
        return out

    def runs_of(self, i: int) -> list[tuple[tuple[int, int], ...]]:
        """Request ``i``'s table runs per group (``snapshot.table_runs``)."""
        from kvscope.layout.snapshot import table_runs

        seg = sum(self.groups[:i])
        at = sum(self.seg_lens[:seg])
        out = []
        for n in self.seg_lens[seg:seg + self.groups[i]]:
            out.append(table_runs(self.flat[at:at + n].tolist()))
            at += n
        return out
