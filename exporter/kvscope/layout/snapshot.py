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
(a sliding-window or Mamba group nulls the entries it no longer needs).

A sampled snapshot's figures are taken with its copy of the pool; its runs and owners are
built from the copy the first time they are read (``Layout``: most samples are never read,
and the build was most of the sampler's CPU). No I/O; the one lock is the build's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from kvscope.layout.owners import FlatTables, flatten, owner_figures
from kvscope.state.engine import EngineState
from kvscope.state.free_run import free_run_lengths
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
    layout: Layout
    """Its ``runs`` and ``owners``, built the first time either is read."""
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    max_contiguous_free: int
    budget_utilization: float | None
    running: int
    waiting: int
    cost: int = 0
    """Bytes this snapshot adds to the history (0 when it shares another's layout): its
    copy's; a build adds its runs' and drops the copy's states' (``Layout.grew``)."""
    server: str = ""
    """The engine's server label (EngineState.server)."""
    preemptions: int = 0
    """Preemptions the sidecar had counted for this session (every reason)."""

    @property
    def key(self) -> str:
        """The engine's name in the sidecar (EngineState.key)."""
        return engine_key(self.server, self.engine)

    @property
    def runs(self) -> np.ndarray:
        """int32 rows (state, owner index or -1, group or -1, length) covering every block."""
        return self.layout.get()[0]

    @property
    def owners(self) -> Sequence[Owner]:
        return self.layout.get()[1]


_BUILD_LOCK = threading.Lock()
"""Held while a layout is built (rarely two at once: one thread must not wait on another's
build for long, and none builds twice)."""


class Layout:
    """A snapshot's pool runs and owners. A sampled one holds the engine's copy and builds
    them from it the first time they are read (a snapshot is read when shown, stored or
    exported; most samples are none of these: the sampler keeps one a second, the store
    one a minute), then lets the copy go. ``grew``, when set, is told how many bytes the
    build added to the snapshot (``Snapshot.cost`` counts the copy)."""

    __slots__ = ("_copy", "_built", "grew", "charged")

    def __init__(self, copy: EngineCopy | None = None,
                 built: tuple[np.ndarray, Sequence[Owner]] | None = None) -> None:
        if (copy is None) == (built is None):
            raise ValueError("a layout is built or has a copy to build from, not both")
        self._copy = copy
        self._built = built
        self.grew: Callable[[Layout, int], None] | None = None
        self.charged = 0
        """Bytes of the build counted by whoever ``grew`` told."""

    @classmethod
    def of(cls, runs: np.ndarray, owners: Sequence[Owner]) -> Layout:
        return cls(built=(runs, owners))

    @property
    def is_built(self) -> bool:
        return self._built is not None

    def get(self) -> tuple[np.ndarray, Sequence[Owner]]:
        built = self._built
        if built is not None:
            return built
        with _BUILD_LOCK:
            built = self._built
            if built is not None:
                return built
            copy = self._copy
            assert copy is not None
            built = self._built = pool_layout(copy)
            self._copy = None
        grew = self.grew
        if grew is not None:  # after the lock: ``grew`` takes its owner's
            grew(self, built[0].nbytes - copy.states.nbytes)
        return built


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
class StateRuns:
    """A pool's block states, kept as runs of one state where that is smaller (an idle
    pool of 131,072 blocks has a handful), else one byte a block (a busy pool of 32,768
    has more runs than a run's five bytes pay for)."""

    starts: np.ndarray | None
    """int32, ascending, the first 0: where each run starts; None: ``values`` has one
    entry per block."""
    values: np.ndarray
    """uint8 ``wire.STATE_*``: each run's, or each block's."""
    num_blocks: int

    @classmethod
    def of(cls, states: bytes | bytearray) -> StateRuns:
        arr = np.frombuffer(states, np.uint8)  # a view, let go on return
        starts = np.flatnonzero(arr[1:] != arr[:-1]).astype(np.int32)
        if 5 * starts.size >= arr.size:
            return cls(None, arr.copy(), arr.size)
        starts += 1
        starts = np.concatenate((np.zeros(min(arr.size, 1), np.int32), starts))
        return cls(starts, arr[starts], arr.size)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (self.starts.nbytes if self.starts is not None else 0)

    def counts(self) -> list[int]:
        """Blocks in each state (index ``wire.STATE_*``)."""
        if self.starts is None:
            return np.bincount(self.values, minlength=wire.STATE_NULL + 1).tolist()
        return np.bincount(self.values, weights=self._lengths(),
                           minlength=wire.STATE_NULL + 1).astype(np.int64).tolist()

    def expand(self) -> np.ndarray:
        """The states, one uint8 per block."""
        if self.starts is None:
            return self.values
        return np.repeat(self.values, self._lengths())

    def _lengths(self) -> np.ndarray:
        assert self.starts is not None
        return np.diff(np.append(self.starts, self.num_blocks))


@dataclass(frozen=True)
class EngineCopy:
    """What a snapshot needs from an EngineState, copied under the hub lock: the block
    states as runs, the tables flattened (one array, ``owners.FlatTables``), the
    requests' tokens in the tables' order, and the longest free run the ledger keeps."""

    hello: wire.Hello
    steps: int
    last_step: wire.Step | None
    states: StateRuns
    tables: FlatTables
    req_ids: tuple[str, ...]
    tokens: list[int]
    longest_free: int
    """The longest run of consecutive free block IDs (``Ledger.max_contiguous_free``)."""
    budget_utilization: float | None
    server: str = ""
    preemptions: int = 0

    @classmethod
    def of(cls, st: EngineState) -> EngineCopy:
        led = st.ledger
        return cls.from_tables(st.hello, st.counters.steps, st.last_step, led.states,
                               led.tables, led.tokens, st.budget_utilization(), st.server,
                               sum(st.counters.preemptions.values()),
                               longest_free=led.max_contiguous_free())

    @classmethod
    def from_tables(cls, hello: wire.Hello, steps: int, last_step: wire.Step | None,
                    states: bytes | bytearray, tables: Mapping[str, list[list[int]]],
                    tokens: Mapping[str, int], budget_utilization: float | None,
                    server: str = "", preemptions: int = 0,
                    longest_free: int | None = None) -> EngineCopy:
        """A copy of a pool given as its parts (nothing of them kept); ``longest_free``
        counted from ``states`` when not given."""
        if longest_free is None:
            longest_free = int(free_run_lengths(states, wire.STATE_CACHED).max(initial=0))
        return cls(hello, steps, last_step, StateRuns.of(states), flatten(tables),
                   tuple(tables), [tokens.get(r, 0) for r in tables], longest_free,
                   budget_utilization, server, preemptions)

    @property
    def nbytes(self) -> int:
        """About what it holds (its tables and tokens as a built snapshot's owners)."""
        return self.states.nbytes + self.tables.nbytes + 96 * len(self.req_ids)


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


def build_snapshot(c: EngineCopy, ts: float) -> Snapshot:
    """A snapshot of a copy of one engine's ledger (no lock needed): its figures now, its
    runs and owners when first read (``Layout``)."""
    counts = c.states.counts()
    free, cached = counts[wire.STATE_FREE], counts[wire.STATE_CACHED]
    last = c.last_step
    return Snapshot(
        engine=c.hello.engine, model=c.hello.model, session=c.hello.session, ts=ts,
        step=c.steps, step_ts=last.ts if last else 0.0, num_blocks=c.states.num_blocks,
        kv_groups=tuple(c.hello.kv_groups), layout=Layout(c),
        free_blocks=free + cached, cached_blocks=cached,
        used_blocks=counts[wire.STATE_USED], max_contiguous_free=c.longest_free,
        budget_utilization=c.budget_utilization,
        running=last.running if last else 0, waiting=last.waiting if last else 0,
        cost=c.nbytes + 256, server=c.server, preemptions=c.preemptions,
    )


def pool_layout(c: EngineCopy) -> tuple[np.ndarray, Owners]:
    """A copied pool's runs and owners."""
    arr = c.states.expand()
    n = arr.size
    multi = len(c.hello.kv_groups) > 1
    rest = SHARED_GROUP if multi else 0
    owner = np.full(n, NO_OWNER, np.int32)
    group = np.full(n, rest, np.int16)
    blocks, shared, frags, tables, listed = owner_figures(c.tables, n, owner,
                                                          group if multi else None)
    owners = Owners(c.req_ids, blocks, frags, c.tokens, shared, tables)
    return pool_runs(arr, owner, group, listed, rest), owners
