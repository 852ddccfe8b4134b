"""A layout snapshot: one engine's block pool at one instant, run-length encoded.

For every block: its state (``wire.STATE_*``: free, cached = free but holding evictable
prefix-cache data, allocated, null), the running request whose block table lists it
(allocated blocks only) and its KV cache group. Stored as rows of
``(state, owner, group, length)`` over consecutive block IDs, which is how the API, the
ClickHouse table and the PNG read it.

Block state is pool-wide. With one KV cache group every block is in group 0; with several,
an allocated block is in the group whose table lists it, and free, cached and null blocks
are shared (group -1). Each owner also keeps its block table per group as runs of
consecutive IDs, ``(first, length)``, where ``first == 0`` is a run of null placeholders
(a sliding-window or Mamba group nulls the entries it no longer needs). Pure functions:
no lock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from kvscope.layout.owners import FlatTables, owner_figures
from kvscope.state.engine import EngineState
from kvscope_probe import wire
from kvscope_probe.identity import engine_key

STATE_NAMES = ("free", "cached", "allocated", "null")
"""Index = ``wire.STATE_*``."""
SHARED_GROUP = -1
NO_OWNER = -1

TableRuns = tuple[tuple[int, int], ...]
"""One group's block table as (first block ID, length) runs; first 0: null placeholders."""


def table_runs(ids: list[int]) -> TableRuns:
    """``[0, 0, 7, 8, 9, 4]`` -> ``((0, 2), (7, 3), (4, 1))``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and ((i == 0 and runs[-1][0] == 0)
                     or (i > 0 and runs[-1][0] > 0 and i == runs[-1][0] + runs[-1][1])):
            runs[-1][1] += 1
        else:
            runs.append([max(i, 0), 1])
    return tuple((a, n) for a, n in runs)


@dataclass(frozen=True)
class GroupTable:
    """A request's block table in one KV cache group."""

    runs: TableRuns

    @property
    def blocks(self) -> int:
        return sum(n for a, n in self.runs if a > 0)

    @property
    def null_blocks(self) -> int:
        return sum(n for a, n in self.runs if a == 0)

    @property
    def fragments(self) -> int:
        return sum(1 for a, _ in self.runs if a > 0)

    def as_json(self, group: int) -> dict[str, Any]:
        return {"group": group, "blocks": self.blocks, "null_blocks": self.null_blocks,
                "fragments": self.fragments, "table": [list(r) for r in self.runs]}


@dataclass(frozen=True)
class Owner:
    """A running request as the layout shows it when a block of it is hovered."""

    req_id: str
    blocks: int
    """Blocks in its table, all KV groups, null placeholders excluded."""
    fragments: int
    """Runs of consecutive block IDs in its table, summed over groups (1 = contiguous)."""
    tokens: int
    """Computed tokens."""
    shared_blocks: int
    """Of its blocks, those an earlier-listed request also holds (prefix-cache sharing)."""
    groups: tuple[GroupTable, ...] = ()
    """Its block table in each KV cache group, in group order."""


@dataclass(frozen=True)
class Snapshot:
    """One engine's pool at one instant (sidecar clock), run-length encoded."""

    engine: str
    model: str
    session: str
    ts: float
    """Sidecar wall time of the sample."""
    step: int
    """Steps the sidecar had ingested for this session."""
    step_ts: float
    """Engine wall time of that step (0.0 before the first step)."""
    num_blocks: int
    kv_groups: tuple[wire.KVGroup, ...]
    runs: np.ndarray
    """int32 rows (state, owner index or -1, group or -1, length) covering every block."""
    owners: Sequence[Owner]
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    max_contiguous_free: int
    budget_utilization: float | None
    running: int
    waiting: int
    cost: int = 0
    """Bytes this snapshot adds to the history (0 when it shares its runs)."""
    server: str = ""
    """The engine's server label (EngineState.server)."""
    preemptions: int = 0
    """Preemptions the sidecar had counted for this session (every reason)."""

    @property
    def key(self) -> str:
        """The engine's name in the sidecar (EngineState.key)."""
        return engine_key(self.server, self.engine)


class Owners(Sequence[Owner]):
    """A sampled pool's owners, in listing order: their figures kept as computed, their
    block tables (``Owner.groups``) built from the flattened tables each time they are
    read (when the snapshot is shown or stored; most samples are neither)."""

    __slots__ = ("req_ids", "blocks", "fragments", "tokens", "shared", "tables")

    def __init__(self, req_ids: tuple[str, ...], blocks: list[int], fragments: list[int],
                 tokens: list[int], shared: list[int], tables: FlatTables) -> None:
        self.req_ids, self.blocks, self.fragments = req_ids, blocks, fragments
        self.tokens, self.shared, self.tables = tokens, shared, tables

    @property
    def nbytes(self) -> int:
        """About what this adds to the sampler's history."""
        return self.tables.nbytes + 96 * len(self.req_ids)

    def __len__(self) -> int:
        return len(self.req_ids)

    def _owner(self, i: int, runs: list[TableRuns]) -> Owner:
        return Owner(self.req_ids[i], self.blocks[i], self.fragments[i], self.tokens[i],
                     self.shared[i], tuple(GroupTable(r) for r in runs))

    @overload
    def __getitem__(self, i: int) -> Owner: ...
    @overload
    def __getitem__(self, i: slice) -> list[Owner]: ...
    def __getitem__(self, i: int | slice) -> Owner | list[Owner]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        k = range(len(self))[i]  # IndexError, negative indices
        return self._owner(k, self.tables.runs_of(k))

    def __iter__(self) -> Iterator[Owner]:
        for i, runs in enumerate(self.tables.runs()):
            yield self._owner(i, runs)


def fragments(ids: list[int]) -> int:
    """Runs of consecutive IDs in one block table (the null block 0 excluded)."""
    runs, prev = 0, None
    for i in ids:
        if i <= 0:
            continue
        if prev is None or i != prev + 1:
            runs += 1
        prev = i
    return runs


def encode_runs(states: np.ndarray, owner: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Run-length encode three per-block arrays into (state, owner, group, length) rows."""
    n = states.size
    if n == 0:
        return np.zeros((0, 4), np.int32)
    diff = (states[1:] != states[:-1]) | (owner[1:] != owner[:-1]) | (group[1:] != group[:-1])
    starts = np.concatenate(([0], np.flatnonzero(diff) + 1))
    lengths = np.diff(np.append(starts, n))
    return np.stack(
        [states[starts], owner[starts], group[starts], lengths], axis=1
    ).astype(np.int32)


def decode_runs(runs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-block (states uint8, owner int32, group int16) arrays back from runs."""
    lengths = runs[:, 3]
    return (
        np.repeat(runs[:, 0], lengths).astype(np.uint8),
        np.repeat(runs[:, 1], lengths).astype(np.int32),
        np.repeat(runs[:, 2], lengths).astype(np.int16),
    )


@dataclass(frozen=True)
class EngineCopy:
    """What a snapshot needs from an EngineState, copied under the hub lock."""

    hello: wire.Hello
    steps: int
    last_step: wire.Step | None
    states: bytes
    tables: dict[str, list[list[int]]]
    tokens: dict[str, int]
    budget_utilization: float | None
    server: str = ""
    preemptions: int = 0

    @classmethod
    def of(cls, st: EngineState) -> EngineCopy:
        led = st.ledger
        return cls(st.hello, st.counters.steps, st.last_step, bytes(led.states),
                   {r: [list(g) for g in t] for r, t in led.tables.items()},
                   dict(led.tokens), st.budget_utilization(), st.server,
                   sum(st.counters.preemptions.values()))


def pool_runs(states: np.ndarray, owner: np.ndarray, group: np.ndarray, listed: np.ndarray,
              rest_group: int) -> np.ndarray:
    """``encode_runs`` of a pool whose ``owner`` is ``NO_OWNER`` and whose ``group`` is
    ``rest_group`` at every block but the ``listed`` ones (sorted block IDs some table
    lists). First sets them back to those values at listed blocks that are not allocated
    (a snapshot draws owners of allocated blocks only). A run can then only split where the
    state changes or at a listed block or the one after it, so what is done per block of
    the pool is comparing neighbouring states; the rest is per listed block."""
    n = states.size
    if n == 0:
        return np.zeros((0, 4), np.int32)
    idle = listed[states[listed] != wire.STATE_USED]
    owner[idle] = NO_OWNER
    group[idle] = rest_group
    near = np.concatenate((listed, listed + 1))
    near = near[(near > 0) & (near < n)]
    cut = states[1:] != states[:-1]  # cut[i - 1]: a run starts at block i
    cut[near[(owner[near] != owner[near - 1]) | (group[near] != group[near - 1])] - 1] = True
    starts = np.flatnonzero(cut)
    starts += 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.append(starts, n))
    return np.stack(
        [states[starts], owner[starts], group[starts], lengths], axis=1
    ).astype(np.int32)


def free_run_lengths(runs: np.ndarray) -> np.ndarray:
    """Lengths of the maximal runs of free (or cached) blocks, from a pool's runs."""
    free = (runs[:, 0] <= wire.STATE_CACHED).astype(np.int8)
    edges = np.diff(np.concatenate(([0], free, [0])))
    at = np.concatenate(([0], np.cumsum(runs[:, 3], dtype=np.int64)))
    return at[np.flatnonzero(edges == -1)] - at[np.flatnonzero(edges == 1)]


def build_snapshot(c: EngineCopy, ts: float) -> Snapshot:
    """Compute a snapshot from a copy of one engine's ledger (no lock needed)."""
    arr = np.frombuffer(c.states, dtype=np.uint8)
    n = arr.size
    multi = len(c.hello.kv_groups) > 1
    rest = SHARED_GROUP if multi else 0
    owner = np.full(n, NO_OWNER, np.int32)
    group = np.full(n, rest, np.int16)
    blocks, shared, frags, tables, listed = owner_figures(c.tables, n, owner,
                                                          group if multi else None)
    owners = Owners(tuple(c.tables), blocks, frags, [c.tokens.get(r, 0) for r in c.tables],
                    shared, tables)
    runs = pool_runs(arr, owner, group, listed, rest)
    free_runs = free_run_lengths(runs)
    counts = np.bincount(runs[:, 0], weights=runs[:, 3], minlength=wire.STATE_NULL + 1)
    last = c.last_step
    return Snapshot(
        engine=c.hello.engine, model=c.hello.model, session=c.hello.session, ts=ts,
        step=c.steps, step_ts=last.ts if last else 0.0, num_blocks=n,
        kv_groups=tuple(c.hello.kv_groups), runs=runs, owners=owners,
        free_blocks=int(counts[wire.STATE_FREE] + counts[wire.STATE_CACHED]),
        cached_blocks=int(counts[wire.STATE_CACHED]),
        used_blocks=int(counts[wire.STATE_USED]),
        max_contiguous_free=int(free_runs.max()) if free_runs.size else 0,
        budget_utilization=c.budget_utilization,
        running=last.running if last else 0, waiting=last.waiting if last else 0,
        cost=runs.nbytes + owners.nbytes + 256, server=c.server, preemptions=c.preemptions,
    )
