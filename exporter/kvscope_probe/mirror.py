"""The probe's one-byte-per-block copy of vLLM's BlockPool, and the ordered block ops.

The BlockPool wrappers append ops on the engine thread; the mirror replays them (``settle``)
at the step's end, before a keyframe and before anything reads it, so a keyframe is a copy
of this mirror, never a scan of ``BlockPool.blocks`` (21 ms at 128k blocks). Every op
carries block IDs read when the wrapper ran, while vLLM had just touched those blocks.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from kvscope_probe import wire

_block_hash = attrgetter("block_hash")

REPAIR_BLOCKS = 2048
"""Blocks of vLLM's pool one step reads, at most, to repair a mirror a contained fault may
have left wrong: the repair walks the pool in slices of this many over several steps."""

AUDIT_PASS_STEPS = 4096
"""Steps in which the audit reads every block of vLLM's pool once, whatever its size
(41 s at 100 steps/s)..."""
AUDIT_EVERY = 8
"""... auditing one step in this many (a slice and one request's table each time: the
call's fixed part, ~4 µs, paid an eighth as often)..."""
AUDIT_MIN_BLOCKS = 64
"""... reading at least this many blocks each time: 256 every 8th step at 128k blocks,
64 up to 32k blocks. A block costs ~150 ns to read (its object is cold in the cache):
measured 2.0 µs a step on average at 32k blocks, 3.9 µs at 128k (benchmarks/README.md)."""

_STATE_AFTER = {wire.OP_ALLOC: wire.STATE_USED, wire.OP_FREE: wire.STATE_FREE,
                wire.OP_FREE_CACHED: wire.STATE_CACHED, wire.OP_UNCACHE: wire.STATE_FREE}


class PoolMirror:
    """Block states plus the block operations and table nullings since the last step."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.ops: list[tuple[int, Any]] = []
        self.settled = 0
        """How many of ``ops`` ``states`` reflects."""
        self.allocs = 0
        """``get_new_blocks`` calls recorded since the step record last read this (its
        untimed wrapper is estimated per call)."""
        self.nulled: list[wire.Nulled] = []
        self.relocated: list[wire.Nulled] = []
        self.null_ctx: tuple[str, int] | None = None
        """(request, KV group) while vLLM replaces that table's blocks by the null block."""
        null = getattr(pool, "null_block", None)
        if null is not None and null.block_id != 0:
            raise RuntimeError(f"vLLM's null block is block {null.block_id}, not 0")
        field = _hash_is_field(pool)
        self.states = self._scan_states()
        self.repair_at: int | None = None
        """Next block the repair reads; None while the mirror is exact."""
        self.sort_freed = _sort_freed_by_field if field else _sort_freed
        self.audit_at = 0
        """Next block the audit reads."""
        self.audit_blocks = max(AUDIT_MIN_BLOCKS, -(-len(self.states)
                                                   // (AUDIT_PASS_STEPS // AUDIT_EVERY)))
        self.audit_wait = 0
        """Steps until the next audit (``audit_due``)."""
        self.audit_turn = 0
        """Counts audits: which running request's table the next one reads."""

    def _scan_states(self) -> bytearray:
        """One full scan of the pool, at attach time only (a fault repairs in slices)."""
        states = bytearray(len(self.pool.blocks))
        self._scan_range(states, 0, len(states))
        return states

    def _scan_range(self, states: bytearray, lo: int, hi: int) -> int:
        """Set ``states`` of blocks ``lo`` to ``hi`` (excluded) from the pool; how many
        blocks were read."""
        states[lo:hi] = self._read(lo, hi)
        return hi - lo

    def _read(self, lo: int, hi: int) -> bytearray:
        """The state of blocks ``lo`` to ``hi`` (excluded) as vLLM's pool holds them (a
        block's ID is its index in ``BlockPool.blocks``; the null block is block 0)."""
        blocks = self.pool.blocks[lo:hi]
        used, free = wire.STATE_USED, wire.STATE_FREE
        if self.pool.enable_caching:
            # vLLM's own property, never the field the probe's fast path reads: what
            # vLLM says, even where the probe's reading of it has gone wrong
            h, cached = _block_hash, wire.STATE_CACHED
            out = bytearray([used if b.ref_cnt else cached if h(b) is not None else free
                             for b in blocks])
        else:
            out = bytearray([used if b.ref_cnt else free for b in blocks])
        if lo == 0 and out:
            out[0] = wire.STATE_NULL
        return out

    def audit_due(self) -> bool:
        """True one step in ``AUDIT_EVERY`` (the first step included)."""
        if self.audit_wait:
            self.audit_wait -= 1
            return False
        self.audit_wait = AUDIT_EVERY - 1
        return True

    def audit(self, running: Any, get_block_ids: Any) -> wire.Audit:
        """The next slice of vLLM's pool (``audit_blocks`` blocks, wrapping round) and
        the block table of the next running request, read from vLLM itself after a step
        (the ops settled); where the mirror differs, it is set right and counted. The
        sidecar compares the slice and the table with its ledger."""
        self.settle()
        n = len(self.states)
        lo = self.audit_at if self.audit_at < n else 0
        hi = min(n, lo + self.audit_blocks)
        truth = self._read(lo, hi)
        mine = self.states[lo:hi]
        fixed = 0
        if truth != mine:
            fixed = sum(a != b for a, b in zip(truth, mine, strict=True))
            self.states[lo:hi] = truth
        self.audit_at = 0 if hi >= n else hi
        rid, table = "", []
        if running:
            self.audit_turn += 1
            rid = running[self.audit_turn % len(running)].request_id
            table = get_block_ids(rid)
        return wire.Audit(lo, bytes(truth), fixed, rid, table)

    @property
    def dirty(self) -> bool:
        """A contained fault may have left ``states`` wrong, and the repair is not done."""
        return self.repair_at is not None

    def mark_dirty(self) -> None:
        """Start the repair over from block 0 (a fault during a repair restarts it)."""
        self.repair_at = 0

    def repair_slice(self, budget: int = REPAIR_BLOCKS) -> bool:
        """Settle, then read the next ``budget`` blocks of the pool into ``states``; True
        when this slice finished the repair. Blocks already read stay exact: the ops that
        follow keep them so, as they keep a clean mirror."""
        lo = self.repair_at
        if lo is None:
            return False
        self.settle()
        n = len(self.states)
        hi = min(n, lo + budget)
        self._scan_range(self.states, lo, hi)
        self.repair_at = None if hi >= n else hi
        return self.repair_at is None

    def take_ops(self) -> tuple[list[tuple[int, list[int]]], list[wire.Nulled],
                                list[wire.Nulled]]:
        """The ops (settled), nullings and relocations since the last call; resets them."""
        self.settle()
        ops, nulled, moved = self.ops, self.nulled, self.relocated
        self.ops = []
        if nulled:  # almost always empty: the same list stays (it is encoded at once), so
            self.nulled = []  # a step allocates no container the collector must count
        if moved:
            self.relocated = []
        self.settled = 0
        return ops, nulled, moved

    def settle(self) -> None:
        """Replay the ops appended since the last settle into ``states``, in order."""
        ops = self.ops
        st = self.states
        for k in range(self.settled, len(ops)):
            kind, ids = ops[k]
            if kind == wire.OP_ALLOC:  # the common case: no state lookup
                for i in ids:
                    st[i] = wire.STATE_USED
                continue
            if kind == wire.OP_UNCACHE_ALL:
                self.states = st = bytearray(
                    wire.STATE_FREE if s == wire.STATE_CACHED else s for s in st)
                continue
            new = _STATE_AFTER[kind]
            for i in ids:
                st[i] = new
        self.settled = len(ops)

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
            self.ops.append((wire.OP_ALLOC, ids))

    def on_free(self, blocks: Any) -> None:
        if self.null_ctx is not None:
            rid, group = self.null_ctx
            self.nulled.append(wire.Nulled(rid, group, [b.block_id for b in blocks]))
        plain: list[int] = []
        cached: list[int] = []
        self.sort_freed(blocks, self.pool, plain, cached)
        if plain:
            self.ops.append((wire.OP_FREE, plain))
        if cached:
            self.ops.append((wire.OP_FREE_CACHED, cached))

    def on_uncache(self, block_ids: Any) -> None:
        self.settle()  # which blocks are cached now
        st = self.states
        ids = [i for i in block_ids if st[i] == wire.STATE_CACHED]
        if ids:
            self.ops.append((wire.OP_UNCACHE, ids))

    def on_uncache_all(self) -> None:
        self.ops.append((wire.OP_UNCACHE_ALL, []))


def _hash_is_field(pool: Any) -> bool:
    """vLLM's ``KVCacheBlock.block_hash`` is a property over the ``_block_hash`` field
    (0.32, 0.33): reading the field is 27 ns a block less, ~1 us a finished request."""
    from kvscope_probe.fingerprint import hash_is_field

    return bool(pool.blocks) and hash_is_field(type(pool.blocks[0]))


def _sort_freed(blocks: Any, pool: Any, plain: list[int], cached: list[int]) -> None:
    """The IDs of ``blocks`` that this free returned to ``pool``, by whether they keep
    prefix-cache data."""
    caching = pool.enable_caching
    for b in blocks:
        if b.ref_cnt == 0 and not b.is_null and (b.pool is None or b.pool is pool):
            (cached if caching and b.block_hash is not None else plain).append(b.block_id)


def _sort_freed_by_field(blocks: Any, pool: Any, plain: list[int], cached: list[int]) -> None:
    """``_sort_freed``, reading ``_block_hash`` where vLLM's property would."""
    caching = pool.enable_caching
    for b in blocks:
        if b.ref_cnt == 0 and not b.is_null and (b.pool is None or b.pool is pool):
            (cached if caching and b._block_hash is not None else plain).append(b.block_id)
