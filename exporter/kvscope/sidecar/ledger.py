"""One engine's KV block pool, rebuilt in the sidecar from the probe's ordered ops.

The ledger is exact while it is in sync: it starts stale, becomes exact at the first
keyframe, and turns stale again at any gap (dropped records, a failed self-check)
until the next keyframe. Stale figures are never papered over: callers ask ``synced``.
"""

from __future__ import annotations

import numpy as np

from kvscope_probe import wire

_FREE_MAX = wire.STATE_CACHED  # states <= this are free (cached ones are evictable)


class Ledger:
    """Block states plus the block tables and token counts of running requests."""

    def __init__(self, num_blocks: int, group_block_sizes: list[int]) -> None:
        self.num_blocks = num_blocks
        self.group_block_sizes = group_block_sizes or [1]
        self.states = bytearray(num_blocks)
        if num_blocks:
            self.states[0] = wire.STATE_NULL
        self.free = max(0, num_blocks - 1)
        self.cached = 0
        self.synced = False
        self.tables: dict[str, list[list[int]]] = {}
        """Block table of every running request, one list per KV group; block 0 is vLLM's
        null block (a placeholder for blocks a sliding window released)."""
        self.computed: dict[str, int] = {}
        """Computed tokens of each request when it was last scheduled, ..."""
        self.scheduled: dict[str, int] = {}
        """... and the tokens scheduled for it then: their sum is what it holds now."""

    # -- block operations -------------------------------------------------------
    def apply(self, ops: list[tuple[int, list[int]]]) -> None:
        """Replay ordered ops; raises ValueError on a block ID outside the pool."""
        st = self.states
        n = self.num_blocks
        for kind, ids in ops:
            if ids and (min(ids) <= 0 or max(ids) >= n):
                bad = next(i for i in ids if not 0 < i < n)
                raise ValueError(f"block id {bad} outside pool of {n}")
            if kind == wire.OP_ALLOC:
                for i in ids:
                    s = st[i]
                    if s <= _FREE_MAX:
                        self.free -= 1
                        self.cached -= s == wire.STATE_CACHED
                    st[i] = wire.STATE_USED
            elif kind in (wire.OP_FREE, wire.OP_FREE_CACHED):
                new = wire.STATE_FREE if kind == wire.OP_FREE else wire.STATE_CACHED
                for i in ids:
                    s = st[i]
                    if s > _FREE_MAX:
                        self.free += 1
                    else:
                        self.cached -= s == wire.STATE_CACHED
                    self.cached += new == wire.STATE_CACHED
                    st[i] = new
            elif kind == wire.OP_UNCACHE:
                for i in ids:
                    if st[i] == wire.STATE_CACHED:
                        st[i] = wire.STATE_FREE
                        self.cached -= 1
            elif kind == wire.OP_UNCACHE_ALL:
                arr = self.array()
                arr[arr == wire.STATE_CACHED] = wire.STATE_FREE
                self.cached = 0
            else:
                raise ValueError(f"unknown block op {kind}")

    def load(self, kf: wire.Keyframe) -> bool:
        """Adopt a keyframe; return True when an in-sync ledger disagreed with it."""
        if len(kf.states) != self.num_blocks:
            raise ValueError(f"keyframe has {len(kf.states)} blocks, pool has {self.num_blocks}")
        mismatch = self.synced and (
            bytes(self.states) != kf.states or self._tables_differ(kf)
            or self.tokens != kf.tokens
        )
        self.states = bytearray(kf.states)
        arr = self.array()
        self.free = int(np.count_nonzero(arr <= _FREE_MAX))
        self.cached = int(np.count_nonzero(arr == wire.STATE_CACHED))
        self.tables = {k: [list(g) for g in v] for k, v in kf.tables.items()}
        self.computed = dict(kf.tokens)
        self.scheduled = {}
        self.synced = True
        return mismatch

    def _tables_differ(self, kf: wire.Keyframe) -> bool:
        if set(self.tables) != set(kf.tables):
            return True
        return any(self.tables[k] != v for k, v in kf.tables.items())

    # -- derived figures ------------------------------------------------------------
    def array(self) -> np.ndarray:
        return np.frombuffer(self.states, dtype=np.uint8)

    def free_runs(self) -> np.ndarray:
        """Lengths of the maximal runs of consecutive free block IDs."""
        free = (self.array() <= _FREE_MAX).astype(np.int8)
        edges = np.diff(np.concatenate(([0], free, [0])))
        return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)

    def max_contiguous_free(self) -> int:
        runs = self.free_runs()
        return int(runs.max()) if runs.size else 0

    @property
    def usable_blocks(self) -> int:
        """Blocks that can ever be free: all but the null block."""
        return max(0, self.num_blocks - 1)

    @property
    def used(self) -> int:
        return self.usable_blocks - self.free

    @property
    def tokens(self) -> dict[str, int]:
        """Tokens each running request holds (computed, this step's included)."""
        sched = self.scheduled
        return {r: n + sched.get(r, 0) for r, n in self.computed.items() if r in self.tables}

    def tail_waste_tokens(self) -> int:
        """Reserved but unfilled token slots in running requests' blocks, all groups."""
        return sum(self.group_figures()[0])

    def tail_waste_by_group(self) -> list[int]:
        return self.group_figures()[0]

    def blocks_by_group(self) -> list[int]:
        return self.group_figures()[1]

    def group_figures(self) -> tuple[list[int], list[int]]:
        """Per KV group, in one pass over the running requests' tables:

        - tail waste: slots reserved in the group's blocks beyond the tokens they hold. A
          block a sliding window released (now the null block) held a full block of
          tokens that left the window: it is no waste, and the formula counts it as full;
        - blocks held: table entries that are not the null block (a block shared by two
          tables counts in each).
        """
        sizes = self.group_block_sizes
        waste = [0] * len(sizes)
        held = [0] * len(sizes)
        computed, sched = self.computed, self.scheduled
        for rid, groups in self.tables.items():
            n = computed.get(rid, 0) + sched.get(rid, 0)
            for g, ids in enumerate(groups[:len(sizes)]):
                k = len(ids)
                if k * sizes[g] > n:
                    waste[g] += k * sizes[g] - n
                held[g] += k - ids.count(0)
        return waste, held

    # -- request tables -----------------------------------------------------------------
    def drop_request(self, req_id: str) -> None:
        self.tables.pop(req_id, None)
        self.computed.pop(req_id, None)
        self.scheduled.pop(req_id, None)

    def apply_tables(self, s: wire.Step) -> None:
        """One step's changes to the running requests' tables and token counts."""
        tables = self.tables
        for rid in s.finished:
            self.drop_request(rid)
        for rid in s.preempted:
            self.drop_request(rid)
        for n in s.nulled:  # before the tables grow: a released block may come back
            table = tables.get(n.req_id)
            if table is not None and 0 <= n.group < len(table):
                gone = set(n.block_ids)
                table[n.group] = [0 if b in gone else b for b in table[n.group]]
        for r in s.new_reqs:
            tables[r.req_id] = [list(g) for g in r.block_ids]
            self.computed[r.req_id] = r.computed_tokens
        self.computed.update(zip(s.cached_ids, s.cached_computed, strict=True))
        self.scheduled.update(s.num_scheduled)
        for rid, n in s.rolled_back.items():
            if rid in tables:
                self.computed[rid] = n
                self.scheduled[rid] = 0
        resumed = s.resumed
        for rid, groups in zip(s.grown_ids, s.grown_blocks, strict=True):
            table = tables.get(rid)
            if table is None or rid in resumed:
                tables[rid] = [list(g) for g in groups]
                continue
            while len(table) < len(groups):
                table.append([])
            for g, ids in enumerate(groups):
                table[g].extend(ids)
