"""Which running request owns each block, and each owner's table figures, for a snapshot.

Computed over every table at once: the tables are flattened into one array in listing
order (request by request, group by group), so the per-block work is a few numpy passes
instead of a Python loop per request and block. The answer is that of reading the tables
one after another: a block belongs to the first table that lists it (later ones count it
as shared), and with several KV groups its group is the last one that lists it.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain

import numpy as np


def owner_figures(tables: Mapping[str, list[list[int]]], n: int, owner: np.ndarray,
                  group: np.ndarray | None) -> tuple[list[int], list[int], list[int],
                                                     list[list[tuple[tuple[int, int], ...]]],
                                                     np.ndarray]:
    """Fill ``owner`` (index of the request in ``tables``' order, per block) and, when
    given, ``group``; return per request its blocks (in the pool, null excluded), shared
    blocks, fragments (``snapshot.fragments`` of each group, summed) and per group its
    table runs (``snapshot.table_runs``); and the IDs of the blocks it filled, sorted."""
    seg_lens = [len(ids) for t in tables.values() for ids in t]
    nreq = len(tables)
    seg_req = np.fromiter((i for i, t in enumerate(tables.values()) for _ in t), np.int64,
                          len(seg_lens))
    seg_group = np.fromiter((g for t in tables.values() for g in range(len(t))), np.int64,
                            len(seg_lens))
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(tables.values())), np.int64,
                       sum(seg_lens))
    seg_of = np.repeat(np.arange(len(seg_lens)), seg_lens)
    req_of = seg_req[seg_of]
    valid = (flat > 0) & (flat < n)
    v, vseg, vreq = flat[valid], seg_of[valid], req_of[valid]
    blocks, first = np.unique(v, return_index=True)
    owner[blocks] = vreq[first]
    shared = vseg > vseg[first][np.searchsorted(blocks, v)]
    if group is not None and v.size:
        rev_blocks, last = np.unique(v[::-1], return_index=True)
        group[rev_blocks] = seg_group[vseg[v.size - 1 - last]]
    pos = flat > 0
    p, pseg = flat[pos], seg_of[pos]
    new_frag = np.ones(p.size, bool)
    new_frag[1:] = (p[1:] != p[:-1] + 1) | (pseg[1:] != pseg[:-1])
    return (np.bincount(vreq, minlength=nreq).tolist(),
            np.bincount(vreq, weights=shared, minlength=nreq).astype(np.int64).tolist(),
            np.bincount(req_of[pos], weights=new_frag, minlength=nreq).astype(np.int64)
            .tolist(),
            _runs_by_request(flat, seg_of, seg_lens, tables), blocks)


def _runs_by_request(flat: np.ndarray, seg_of: np.ndarray, seg_lens: list[int],
                     tables: Mapping[str, list[list[int]]]
                     ) -> list[list[tuple[tuple[int, int], ...]]]:
    """Each table's runs: consecutive IDs, or consecutive null placeholders (0)."""
    if flat.size and int(flat.min()) < 0:  # never from vLLM; the reference loop decides
        from kvscope.layout.snapshot import table_runs

        return [[table_runs(ids) for ids in t] for t in tables.values()]
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
    for t in tables.values():
        groups = []
        for _ in t:
            groups.append(tuple(runs[k:k + per_seg[s]]))
            k += per_seg[s]
            s += 1
        out.append(groups)
    return out
