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
        self.tokens: dict[str, int] = {}

    # -- block operations -------------------------------------------------------
    def apply(self, ops: list[tuple[int, list[int]]]) -> None:
        """Replay ordered ops; raises ValueError on a block ID outside the pool."""
        st = self.states
        n = self.num_blocks
        for kind, ids in ops:
            for i in ids:
                if not 0 < i < n:
                    raise ValueError(f"block id {i} outside pool of {n}")
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
        )
        self.states = bytearray(kf.states)
        arr = self.array()
        self.free = int(np.count_nonzero(arr <= _FREE_MAX))
        self.cached = int(np.count_nonzero(arr == wire.STATE_CACHED))
        self.tables = {k: [list(g) for g in v] for k, v in kf.tables.items()}
        self.tokens = dict(kf.tokens)
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

    def tail_waste_tokens(self) -> int:
        """Reserved but unfilled token slots in running requests' blocks."""
        waste = 0
        sizes = self.group_block_sizes
        for rid, groups in self.tables.items():
            tokens = self.tokens.get(rid, 0)
            for bs, ids in zip(sizes, groups, strict=False):
                waste += max(0, len(ids) * bs - tokens)
        return waste

    # -- request tables -----------------------------------------------------------------
    def drop_request(self, req_id: str) -> None:
        self.tables.pop(req_id, None)
        self.tokens.pop(req_id, None)

    def set_table(self, req_id: str, block_ids: list[list[int]], tokens: int) -> None:
        self.tables[req_id] = [list(g) for g in block_ids]
        self.tokens[req_id] = tokens

    def extend_table(self, req_id: str, new_ids: list[list[int]] | None, tokens: int) -> None:
        table = self.tables.setdefault(req_id, [[] for _ in self.group_block_sizes])
        if new_ids:
            while len(table) < len(new_ids):
                table.append([])
            for g, ids in enumerate(new_ids):
                table[g].extend(ids)
        self.tokens[req_id] = tokens
