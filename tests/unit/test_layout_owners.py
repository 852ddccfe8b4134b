"""The snapshot's owners computed over all tables at once equal reading the tables one
after another, and its runs and figures equal a pass over every block for each (what
build_snapshot did before; kept here as the references)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvscope.layout.owners import owner_figures
from kvscope.layout.snapshot import (
    NO_OWNER,
    SHARED_GROUP,
    EngineCopy,
    build_snapshot,
    encode_runs,
    fragments,
    table_runs,
)
from kvscope_probe import wire


def reference(tables: dict[str, list[list[int]]], n: int, multi: bool):
    owner = np.full(n, -1, np.int32)
    group = np.full(n, -1 if multi else 0, np.int16)
    listers: dict[int, set[int]] = {}
    for idx, table in enumerate(tables.values()):
        for ids in table:
            for b in ids:
                if 0 < b < n:
                    listers.setdefault(b, set()).add(idx)
    out = []
    for idx, table in enumerate(tables.values()):
        total = shared = frags = 0
        for g, ids in enumerate(table):
            a = np.asarray(ids, dtype=np.int64)
            a = a[(a > 0) & (a < n)]
            taken = owner[a] != -1
            shared += sum(len(listers[b]) > 1 for b in a.tolist())  # another request lists it
            owner[a[~taken]] = idx
            if multi:
                group[a] = g
            total += a.size
            frags += fragments(ids)
        out.append((total, shared, frags, [table_runs(ids) for ids in table]))
    return owner, group, out


def random_tables(rng: random.Random, n: int, groups: int) -> dict[str, list[list[int]]]:
    tables = {}
    for r in range(rng.randint(0, 40)):
        table = []
        for _ in range(groups):
            ids: list[int] = []
            for _ in range(rng.randint(0, 6)):
                kind = rng.random()
                if kind < 0.15:
                    ids += [0] * rng.randint(1, 3)  # null placeholders
                elif kind < 0.2:
                    ids.append(n + rng.randint(0, 3))  # outside the pool: not drawn
                else:
                    start = rng.randint(1, n - 1)
                    ids += range(start, min(n, start + rng.randint(1, 8)))
            table.append(ids)
        tables[f"r{r}"] = table
    return tables


@pytest.mark.parametrize("dense", [True, False], ids=["scatter", "sort"])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_owner_figures_equal_the_table_by_table_reading(groups: int, dense: bool) -> None:
    rng = random.Random(groups)
    for _ in range(300):
        n = rng.randint(2, 64)  # small pools: many blocks listed by several tables
        tables = random_tables(rng, n, groups)
        multi = groups > 1
        want_owner, want_group, want = reference(tables, n, multi)
        owner = np.full(n, -1, np.int32)
        group = np.full(n, -1 if multi else 0, np.int16)
        blocks, shared, frags, flat, listed = owner_figures(tables, n, owner,
                                                            group if multi else None, dense)
        runs = flat.runs()
        assert runs == [flat.runs_of(i) for i in range(len(tables))]
        assert owner.tolist() == want_owner.tolist()
        assert listed.tolist() == np.flatnonzero(want_owner != -1).tolist()
        assert group.tolist() == want_group.tolist()
        assert [(b, s, f, r) for b, s, f, r in zip(blocks, shared, frags, runs, strict=True)] \
            == [(t, s, f, r) for t, s, f, r in want]


def test_negative_ids_take_the_reference_runs() -> None:
    tables = {"a": [[-1, 0, 0, 3, 4]], "b": [[]]}
    owner = np.full(8, -1, np.int32)
    _, _, _, flat, listed = owner_figures(tables, 8, owner, None)
    assert flat.runs() == [[table_runs([-1, 0, 0, 3, 4])], [()]]
    assert owner.tolist() == [-1, -1, -1, 0, 0, -1, -1, -1]
    assert listed.tolist() == [3, 4]


def reference_pool(states: np.ndarray, tables: dict[str, list[list[int]]], multi: bool
                   ) -> tuple[list[list[int]], int, int, int, int]:
    """The pool's runs and figures as build_snapshot computed them before (a pass over
    every block for each figure): runs, free, cached, used, longest free run."""
    n = states.size
    owner, group, _ = reference(tables, n, multi)
    used = states == wire.STATE_USED
    owner[~used] = NO_OWNER
    if multi:
        group[~used] = SHARED_GROUP
    free = states <= wire.STATE_CACHED
    edges = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
    runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    return (encode_runs(states, owner, group).tolist(), int(np.count_nonzero(free)),
            int(np.count_nonzero(states == wire.STATE_CACHED)), int(np.count_nonzero(used)),
            int(runs.max()) if runs.size else 0)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_a_snapshot_equals_the_pass_per_figure_reading(groups: int) -> None:
    """build_snapshot splits runs only at state changes and listed blocks: the same runs
    and figures as reading every block for each, on pools with tables that list free,
    cached or null blocks, blocks outside the pool and blocks of other tables."""
    rng = random.Random(100 + groups)
    kinds = [wire.KVGroup("FullAttentionSpec", 16)] * groups
    for _ in range(300):
        n = rng.randint(1, 96)
        states = np.array([rng.choice((wire.STATE_FREE, wire.STATE_CACHED, wire.STATE_USED,
                                       wire.STATE_USED)) for _ in range(n)], np.uint8)
        states[0] = wire.STATE_NULL
        if rng.random() < 0.3:  # long runs of one state, as in a real pool
            states[1:] = np.repeat(states[1:], 8)[: n - 1]
        tables = random_tables(rng, max(n, 2), groups)
        hello = wire.Hello("e", "s", 1, "0", "m", n, 16, kinds, 64, 64, 8, "fcfs", True, 0.0)
        snap = build_snapshot(
            EngineCopy.from_tables(hello, 1, None, states.tobytes(), tables, {}, None), 1.0)
        runs, free, cached, used, longest = reference_pool(states, tables, groups > 1)
        assert snap.runs.tolist() == runs
        _, _, want = reference(tables, n, groups > 1)
        owners = list(snap.owners)  # the tables' runs built all at once, as when stored
        assert [(o.req_id, o.blocks, o.shared_blocks, o.fragments,
                 [t.runs for t in o.groups]) for o in owners] \
            == [(r, b, s, f, t) for r, (b, s, f, t) in zip(tables, want, strict=True)]
        assert [snap.owners[i] for i in range(len(tables))] == owners  # one by one
        assert snap.owners[-1:] == owners[-1:]
        assert (snap.free_blocks, snap.cached_blocks, snap.used_blocks,
                snap.max_contiguous_free) == (free, cached, used, longest)


def test_the_scatter_is_chosen_where_it_was_measured_cheaper() -> None:
    """benchmarks/README.md, fourteenth pass: 256 running in 32,768 blocks (10,844
    listings) the scatter; 32 running in 131,072 blocks (1,504) the sort."""
    from kvscope.layout.owners import dense_is_cheaper

    assert dense_is_cheaper(10_844, 32_768)
    assert not dense_is_cheaper(1_504, 131_072)
    assert not dense_is_cheaper(0, 8)
