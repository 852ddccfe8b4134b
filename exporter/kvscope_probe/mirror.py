"""The probe's one-byte-per-block copy of vLLM's BlockPool, and the ordered block ops.

Kept up to date by the BlockPool wrappers on the engine thread, so a keyframe is a copy of
this mirror, never a scan of ``BlockPool.blocks`` (21 ms at 128k blocks).
"""

from __future__ import annotations

from typing import Any

from kvscope_probe import wire


class PoolMirror:
    """Block states plus the block operations and table nullings since the last step."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.ops: list[tuple[int, list[int]]] = []
        self.nulled: list[wire.Nulled] = []
        self.relocated: list[wire.Nulled] = []
        self.null_ctx: tuple[str, int] | None = None
        """(request, KV group) while vLLM replaces that table's blocks by the null block."""
        self.states = self._scan_states()

    def _scan_states(self) -> bytearray:
        """One full scan of the pool: at attach time and after a contained fault only."""
        states = bytearray(len(self.pool.blocks))
        for b in self.pool.blocks:
            if b.is_null:
                states[b.block_id] = wire.STATE_NULL
            elif b.ref_cnt > 0:
                states[b.block_id] = wire.STATE_USED
            elif b.block_hash is not None and self.pool.enable_caching:
                states[b.block_id] = wire.STATE_CACHED
        return states

    def take_ops(self) -> tuple[list[tuple[int, list[int]]], list[wire.Nulled],
                                list[wire.Nulled]]:
        """The ops, nullings and relocations since the last call; resets them."""
        ops, nulled, moved = self.ops, self.nulled, self.relocated
        self.ops, self.nulled, self.relocated = [], [], []
        return ops, nulled, moved

    def on_relocate(self, manager: Any, req_blocks: Any, block_idx: int) -> None:
        """``manager`` moved ``req_blocks[block_idx]`` to the end of that table (the null
        block now in its place). Which request owns the table is found by identity: this
        happens only for Mamba groups with prefix caching and speculative decoding."""
        rid = next((r for r, b in manager.req_to_blocks.items() if b is req_blocks), None)
        if rid is not None:
            block = req_blocks[-1]
            self.relocated.append(
                wire.Nulled(rid, manager.kv_cache_group_id, [block.block_id]))

    def on_alloc(self, blocks: Any) -> None:
        ids = [b.block_id for b in blocks]
        if ids:
            st = self.states
            for i in ids:
                st[i] = wire.STATE_USED
            self.ops.append((wire.OP_ALLOC, ids))

    def on_free(self, blocks: Any) -> None:
        if self.null_ctx is not None:
            rid, group = self.null_ctx
            self.nulled.append(wire.Nulled(rid, group, [b.block_id for b in blocks]))
        plain: list[int] = []
        cached: list[int] = []
        pool = self.pool
        caching = pool.enable_caching
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null and (b.pool is None or b.pool is pool):
                (cached if caching and b.block_hash is not None else plain).append(b.block_id)
        st = self.states
        if plain:
            for i in plain:
                st[i] = wire.STATE_FREE
            self.ops.append((wire.OP_FREE, plain))
        if cached:
            for i in cached:
                st[i] = wire.STATE_CACHED
            self.ops.append((wire.OP_FREE_CACHED, cached))

    def on_uncache(self, block_ids: Any) -> None:
        st = self.states
        ids = [i for i in block_ids if st[i] == wire.STATE_CACHED]
        for i in ids:
            st[i] = wire.STATE_FREE
        if ids:
            self.ops.append((wire.OP_UNCACHE, ids))

    def on_uncache_all(self) -> None:
        self.states = bytearray(
            wire.STATE_FREE if s == wire.STATE_CACHED else s for s in self.states
        )
        self.ops.append((wire.OP_UNCACHE_ALL, []))
