"""One engine's KV block pool, rebuilt in the sidecar from the probe's ordered ops.

The ledger is exact while it is in sync: it starts stale, becomes exact at the first
keyframe, and turns stale again at any gap (dropped records, a failed self-check)
until the next keyframe. Stale figures are never papered over: callers ask ``synced``.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from kvscope.state.capacity import STATE_KINDS
from kvscope.state.free_run import ALL, SCAN_BELOW, LongestFreeRun, free_run_lengths
from kvscope.state.token_counts import ListEdit, TokenCounts
from kvscope_probe import wire

_FREE_MAX = wire.STATE_CACHED  # states <= this are free (cached ones are evictable)
_FREE_STATE, _CACHED, _USED = wire.STATE_FREE, wire.STATE_CACHED, wire.STATE_USED
_ALLOC, _FREE, _FREE_CACHED = wire.OP_ALLOC, wire.OP_FREE, wire.OP_FREE_CACHED


class Ledger:
    """Block states plus the block tables and token counts of running requests."""

    def __init__(self, num_blocks: int, group_block_sizes: list[int],
                 group_kinds: list[str] | None = None) -> None:
        self.num_blocks = num_blocks
        self.usable_blocks = max(0, num_blocks - 1)
        """Blocks that can ever be free: all but the null block."""
        self.group_block_sizes = group_block_sizes or [1]
        kinds = group_kinds or []
        self.group_slots = [i >= len(kinds) or kinds[i] not in STATE_KINDS
                            for i in range(len(self.group_block_sizes))]
        """Per KV group, whether its blocks hold token slots (a Mamba group's hold one
        recurrent state each: ``capacity.STATE_KINDS``)."""
        self.states = bytearray(num_blocks)
        if num_blocks:
            self.states[0] = wire.STATE_NULL
        self.free = max(0, num_blocks - 1)
        self.cached = 0
        self.synced = False
        self.awaiting = False
        """A keyframe sent across steps (``Keyframe.pending``) came while stale: the ledger
        is in sync once its last ``KeyframeTables`` arrives, unless it goes stale first."""
        self.tables: dict[str, list[list[int]]] = {}
        """Block table of every running request, one list per KV group; block 0 is vLLM's
        null block (a placeholder for blocks a sliding window released)."""
        self.counts = TokenCounts()
        """Computed tokens of each request when it was last scheduled, and the tokens
        scheduled for it then: their sum is what it holds now."""
        self.nulls = [0] * len(self.group_block_sizes)
        """Null-block entries (0) in the tables, per KV group: kept as the tables change,
        so a scrape counts held blocks without reading every table."""
        self.version = 0
        """Bumped whenever the block states change: figures of the states are cached per
        version (a scrape, the request tracker and the sampler share one computation)."""
        self._runs: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))
        self._longest = LongestFreeRun(_FREE_MAX)
        self._longest_at = (-1, 0)  # (version, the longest free run then)
        self._marked = ALL
        """Chunks of the blocks changed since the longest run was measured
        (``LongestFreeRun.chunks_of``)."""

    # -- block operations -------------------------------------------------------
    def apply(self, ops: list[tuple[int, list[int]]]) -> None:
        """Replay ordered ops; raises ValueError on a block ID outside the pool."""
        if not ops:
            return
        self.version += 1
        st = self.states
        n = self.num_blocks
        free, cached = self.free, self.cached  # kept in locals, stored back once
        marked, shift, chunks_of = self._marked, self._longest.shift, self._longest.chunks_of
        try:
            for kind, ids in ops:
                if kind == _ALLOC and len(ids) == 1:  # most ops: a table grew one block
                    i = ids[0]
                    if not 0 < i < n:
                        raise ValueError(f"block id {i} outside pool of {n}")
                    marked |= 1 << (i >> shift)  # chunks_of(i, i), without the call
                    s = st[i]
                    if s <= _FREE_MAX:
                        free -= 1
                        if s == _CACHED:
                            cached -= 1
                    st[i] = _USED
                    continue
                if ids:
                    lo, hi = min(ids), max(ids)
                    if lo <= 0 or hi >= n:
                        bad = next(i for i in ids if not 0 < i < n)
                        raise ValueError(f"block id {bad} outside pool of {n}")
                    marked |= chunks_of(lo, hi)
                if kind == _ALLOC:
                    for i in ids:
                        s = st[i]
                        if s <= _FREE_MAX:
                            free -= 1
                            if s == _CACHED:
                                cached -= 1
                        st[i] = _USED
                elif kind == _FREE or kind == _FREE_CACHED:
                    new = _FREE_STATE if kind == _FREE else _CACHED
                    for i in ids:
                        s = st[i]
                        if s > _FREE_MAX:
                            free += 1
                        elif s == _CACHED:
                            cached -= 1
                        if new == _CACHED:
                            cached += 1
                        st[i] = new
                elif kind == wire.OP_UNCACHE:
                    for i in ids:
                        if st[i] == _CACHED:
                            st[i] = _FREE_STATE
                            cached -= 1
                elif kind == wire.OP_UNCACHE_ALL:
                    arr = self.array()
                    arr[arr == _CACHED] = _FREE_STATE
                    cached = 0
                    marked = ALL
                else:
                    raise ValueError(f"unknown block op {kind}")
        finally:
            self.free, self.cached, self._marked = free, cached, marked

    def stale(self) -> None:
        """Out of sync (a gap, a failed check) until the next keyframe is whole."""
        self.synced = False
        self.awaiting = False

    def load(self, kf: wire.Keyframe) -> bool:
        """Adopt a keyframe; return True when an in-sync ledger disagreed with it. The
        tables of its ``pending`` requests follow (``load_tables``): an in-sync ledger keeps
        its own until then and stays in sync; a stale one is in sync after the last."""
        if len(kf.states) != self.num_blocks:
            raise ValueError(f"keyframe has {len(kf.states)} blocks, pool has {self.num_blocks}")
        states = np.frombuffer(kf.states, dtype=np.uint8)  # checked before anything is replaced
        if states.size and (states[0] != wire.STATE_NULL
                            or int(states[1:].max(initial=0)) > wire.STATE_USED):
            raise ValueError("keyframe states: block 0 is not the null block, or a block "
                             "has an unknown state")
        self._check_tables(kf.tables)
        pending = kf.pending
        mismatch = self.synced and (
            bytes(self.states) != kf.states or self._tables_differ(kf)
            or self.tokens != kf.tokens
        )
        old = self.tables
        self.states = bytearray(kf.states)
        self._marked = ALL
        arr = self.array()
        self.free = int(np.count_nonzero(arr <= _FREE_MAX))
        self.cached = int(np.count_nonzero(arr == wire.STATE_CACHED))
        self.version += 1
        self.tables = {}
        self.nulls = [0] * len(self.group_block_sizes)
        for rid, groups in kf.tables.items():
            self._set_table(rid, groups)
        for rid in pending:  # its own table until the keyframe's arrives (or none)
            table = old.get(rid)
            if table is not None and rid not in self.tables:
                self.tables[rid] = table
                self._count_nulls(table, 1)
        self.counts.reset(kf.tokens)
        self.awaiting = bool(pending) and not self.synced
        self.synced = self.synced or not pending
        return mismatch

    def load_tables(self, part: wire.KeyframeTables) -> bool:
        """Adopt the tables of a keyframe's slice, read by the probe after the step this
        ledger applied last; True when an in-sync ledger held other tables for them."""
        self._check_tables(part.tables)
        tables = self.tables
        mismatch = self.synced and any(tables.get(k) != v for k, v in part.tables.items())
        for rid, groups in part.tables.items():
            self._set_table(rid, groups)
        if part.last and self.awaiting:
            self.synced, self.awaiting = True, False
        return mismatch

    def _tables_differ(self, kf: wire.Keyframe) -> bool:
        if set(self.tables) != set(kf.tables).union(kf.pending):
            return True
        return any(self.tables[k] != v for k, v in kf.tables.items())

    # -- derived figures ------------------------------------------------------------
    def array(self) -> np.ndarray:
        return np.frombuffer(self.states, dtype=np.uint8)

    def free_runs(self) -> np.ndarray:
        """Lengths of the maximal runs of consecutive free block IDs, sorted (computed
        once per version of the states: do not modify the array)."""
        version, runs = self._runs
        if version != self.version:
            runs = np.sort(free_run_lengths(self.states, _FREE_MAX))
            self._runs = (self.version, runs)
        return runs

    def free_runs_at_most(self, lengths: tuple[int, ...]) -> list[int]:
        """How many free runs are no longer than each of ``lengths`` (sorted ascending)."""
        return np.searchsorted(self.free_runs(), lengths, side="right").tolist()

    def max_contiguous_free(self) -> int:
        """The longest run of consecutive free block IDs (sampled ten times a second per
        engine: recomputed only in the chunks the ops since touched, ``free_run``)."""
        version, longest = self._longest_at
        if version != self.version:
            if self.num_blocks < SCAN_BELOW:  # a small pool: its runs, in one pass
                runs = self.free_runs()
                longest = int(runs[-1]) if runs.size else 0
            else:
                longest = self._longest.measure(self.states, self._marked)
            self._longest_at = (self.version, longest)
            self._marked = 0
        return longest


    @property
    def used(self) -> int:
        return self.usable_blocks - self.free

    @property
    def tokens(self) -> dict[str, int]:
        """Tokens each running request holds (computed, this step's included)."""
        counts = self.counts
        rids = [r for r in self.tables if r in counts]
        return dict(zip(rids, counts.tokens(rids).tolist(), strict=True))

    def tail_waste_tokens(self) -> int:
        """Reserved but unfilled token slots in running requests' blocks, all groups."""
        return sum(self.group_figures()[0])

    def tail_waste_by_group(self) -> list[int]:
        return self.group_figures()[0]

    def blocks_by_group(self) -> list[int]:
        return self.group_figures()[1]

    def group_figures(self) -> tuple[list[int], list[int], list[int]]:
        """Per KV group, from the tables' lengths and the null counts kept as they change
        (no table is read entry by entry: a scrape of 8 engines x 256 requests does this):

        - tail waste: slots reserved in the group's blocks beyond the tokens they hold. A
          block a sliding window released (now the null block) held a full block of
          tokens that left the window: it is no waste, and the formula counts it as full.
          A Mamba group's blocks hold states, not slots: its waste is 0;
        - blocks held: table entries that are not the null block (a block shared by two
          tables counts in each);
        - token slots: the slots of the group's table entries (null ones as full, as the
          waste counts them), each at the group's own block size; 0 for a Mamba group.
          The occupancy ratio is 1 - waste / slots over all groups.
        """
        sizes = self.group_block_sizes
        tables = self.tables
        if not tables:
            return [0] * len(sizes), [0] * len(sizes), [0] * len(sizes)
        rids = list(tables)
        tokens = self.counts.tokens(rids)
        waste, held, slots = [], [], []
        shortest = min(map(len, tables.values()))
        for g, bs in enumerate(sizes):
            if shortest > g:
                lens = np.fromiter(map(len, map(itemgetter(g), tables.values())), np.int64,
                                   len(rids))
            else:  # a table without this group (never from vLLM): it holds nothing there
                lens = np.fromiter((len(t[g]) if len(t) > g else 0 for t in tables.values()),
                                   np.int64, len(rids))
            entries = int(lens.sum())
            if self.group_slots[g]:
                waste.append(int(np.maximum(lens * bs - tokens, 0).sum()))
                slots.append(entries * bs)
            else:
                waste.append(0)
                slots.append(0)
            held.append(entries - self.nulls[g])
        return waste, held, slots

    # -- request tables -----------------------------------------------------------------
    def _count_nulls(self, groups: list[list[int]], sign: int) -> None:
        nulls = self.nulls
        for g, ids in enumerate(groups[:len(nulls)]):
            nulls[g] += sign * ids.count(0)

    def _check_ids(self, ids: list[int]) -> None:
        """Raise ValueError unless every ID of a table's group is a block of the pool (0,
        the null block, included): an ID outside it would be kept in the table and break
        whatever reads the tables later (the layout sampler's arrays)."""
        n = self.num_blocks
        if len(ids) > 8 and 0 <= min(ids) and max(ids) < n:  # a whole table: at C speed
            return
        for i in ids:  # a step's growth, a block or two: two builtin calls cost 5x more
            if not 0 <= i < n:
                raise ValueError(f"block id {i} in a block table, outside pool of {n}")

    def _check_tables(self, tables: dict[str, list[list[int]]]) -> None:
        """``_check_ids`` for every table of a keyframe or slice, before any is adopted."""
        for groups in tables.values():
            for ids in groups:
                self._check_ids(ids)

    def _set_table(self, req_id: str, groups: list[list[int]]) -> None:
        """A whole table (admitted, resumed or from a keyframe), copied; ValueError, and
        nothing stored, when an ID is outside the pool."""
        for ids in groups:
            self._check_ids(ids)
        old = self.tables.get(req_id)
        if old is not None:
            self._count_nulls(old, -1)
        table = self.tables[req_id] = [list(g) for g in groups]
        self._count_nulls(table, 1)

    def drop_request(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        if table is not None:
            self._count_nulls(table, -1)
        self.counts.drop(req_id)

    def apply_tables(self, s: wire.Step, edit: ListEdit | None = None) -> None:
        """One step's changes to the running requests' tables and token counts; ``edit``:
        how ``s.cached_ids`` was made from the list before (``TokenCounts.step``)."""
        tables = self.tables
        counts = self.counts
        sched = s.scheduled_counts
        # The counts first: the requests that left are not in this step's list, and are
        # dropped after it has set the rest apart (token_counts).
        if sched:  # cached_ids' counts, then the new requests' (checked by the caller)
            counts.step(s.cached_ids, s.cached_computed, sched, edit)
        else:
            counts.store(s.cached_ids, s.cached_computed, s.num_scheduled)
        for rid in s.finished:
            self.drop_request(rid)
        for rid in s.preempted:
            self.drop_request(rid)
        # Before the tables grow: a released block may come back, and a relocated one
        # comes back in the step's new blocks, at the table's end.
        for n in (*s.nulled, *s.relocated):
            table = tables.get(n.req_id)
            if table is not None and 0 <= n.group < len(table):
                gone = set(n.block_ids)
                old = table[n.group]
                table[n.group] = [0 if b in gone else b for b in old]
                if n.group < len(self.nulls):
                    self.nulls[n.group] += table[n.group].count(0) - old.count(0)
        news = s.new_reqs  # their scheduled counts follow cached_ids' (in the dict form: set)
        for r, n in zip(news, sched[len(s.cached_ids):] if sched else [None] * len(news),
                        strict=True):
            self._set_table(r.req_id, r.block_ids)
            counts.set(r.req_id, r.computed_tokens, n)
        for rid, n in s.rolled_back.items():
            if rid in tables:
                counts.set(rid, n, 0)
        resumed = set(s.resumed) if s.resumed else None  # most steps resume nobody
        nulls = self.nulls
        table_of = tables.get
        n_blocks = self.num_blocks
        for rid, groups in zip(s.grown_ids, s.grown_blocks, strict=True):  # ~16 at 256 running
            table = table_of(rid)
            if table is None or resumed is not None and rid in resumed:
                self._set_table(rid, groups)
                continue
            if len(groups) == 1 and table:  # one KV group, as most models have
                ids = groups[0]
                for i in ids:  # a block or two: no builtin call (min/max: +46 k a step)
                    if not 0 <= i < n_blocks:
                        self._check_ids(ids)  # raises, before the table grows
                table[0].extend(ids)
                if 0 in ids:
                    nulls[0] += ids.count(0)
                continue
            for ids in groups:
                self._check_ids(ids)
            while len(table) < len(groups):
                table.append([])
            for g, (held, ids) in enumerate(zip(table, groups, strict=False)):  # table: >= groups
                held.extend(ids)
                if 0 in ids and g < len(nulls):
                    nulls[g] += ids.count(0)
