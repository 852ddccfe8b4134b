"""The snapshot's owners computed over all tables at once equal reading the tables one
after another (the loop build_snapshot ran before, kept here as the reference)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvscope.layout.owners import owner_figures
from kvscope.layout.snapshot import fragments, table_runs


def reference(tables: dict[str, list[list[int]]], n: int, multi: bool):
    owner = np.full(n, -1, np.int32)
    group = np.full(n, -1 if multi else 0, np.int16)
    out = []
    for idx, table in enumerate(tables.values()):
        total = shared = frags = 0
        for g, ids in enumerate(table):
            a = np.asarray(ids, dtype=np.int64)
            a = a[(a > 0) & (a < n)]
            taken = owner[a] != -1
            shared += int(np.count_nonzero(taken))
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


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_owner_figures_equal_the_table_by_table_reading(groups: int) -> None:
    rng = random.Random(groups)
    for _ in range(300):
        n = rng.randint(2, 64)  # small pools: many blocks listed by several tables
        tables = random_tables(rng, n, groups)
        multi = groups > 1
        want_owner, want_group, want = reference(tables, n, multi)
        owner = np.full(n, -1, np.int32)
        group = np.full(n, -1 if multi else 0, np.int16)
        blocks, shared, frags, runs = owner_figures(tables, n, owner, group if multi else None)
        assert owner.tolist() == want_owner.tolist()
        assert group.tolist() == want_group.tolist()
        assert [(b, s, f, r) for b, s, f, r in zip(blocks, shared, frags, runs, strict=True)] \
            == [(t, s, f, r) for t, s, f, r in want]


def test_negative_ids_take_the_reference_runs() -> None:
    tables = {"a": [[-1, 0, 0, 3, 4]], "b": [[]]}
    owner = np.full(8, -1, np.int32)
    _, _, _, runs = owner_figures(tables, 8, owner, None)
    assert runs == [[table_runs([-1, 0, 0, 3, 4])], [()]]
    assert owner.tolist() == [-1, -1, -1, 0, 0, -1, -1, -1]
