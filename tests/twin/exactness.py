"""The sidecar's ledger against vLLM's real pool, compared at the end of every schedule().

``PoolCheck(probed)`` wraps the scheduler of a ``ProbedTwin`` so that, each time the
probe has recorded a step, the ring is drained into the hub and the ledger is compared
with a full scan of vLLM's ``BlockPool`` and with ``KVCacheManager.get_block_ids``: the
free set, the cached (free, evictable) set, their counts, the longest free run, the set
of running requests, each one's block table in every KV cache group (the null block 0
where vLLM keeps it as a placeholder included) and its computed tokens. The first
difference raises ``AssertionError`` naming the step and what differed.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable
from itertools import combinations, product
from typing import Any

import pytest

from kvscope.twin.probed import ProbedTwin
from kvscope_probe import wire


def pool_truth(pool: Any) -> tuple[set[int], set[int]]:
    """Free and free-but-cached block IDs by a full scan of vLLM's pool."""
    free, cached = set(), set()
    for b in pool.blocks:
        if b.ref_cnt == 0 and not b.is_null:
            free.add(b.block_id)
            if b.block_hash is not None:
                cached.add(b.block_id)
    return free, cached


def dict_materialised(obj: Any) -> bool:
    """Whether ``obj``'s attributes live in a dict object rather than CPython's inline
    slots (3.11+): that dict is then among its referents, each of its keys an attribute
    of ``obj`` holding that very value (a dict-valued attribute is a referent too, keyed
    otherwise). Reading ``obj.__dict__`` moves them there for good, and every attribute
    read of ``obj`` takes the slow generic path."""
    missing = object()
    return any(type(r) is dict and r
               and all(type(k) is str and getattr(obj, k, missing) is v for k, v in r.items())
               for r in gc.get_referents(obj))


def truth_states(pool: Any) -> bytes:
    """One STATE_* byte per block, by a full scan of vLLM's pool."""
    free, cached = pool_truth(pool)
    out = bytearray([wire.STATE_USED]) * len(pool.blocks)
    for i in free:
        out[i] = wire.STATE_CACHED if i in cached else wire.STATE_FREE
    for b in pool.blocks:
        if b.is_null:
            out[b.block_id] = wire.STATE_NULL
    return bytes(out)


def max_run(ids: set[int]) -> int:
    best = run = 0
    prev = None
    for i in sorted(ids):
        run = run + 1 if prev is not None and i == prev + 1 else 1
        best = max(best, run)
        prev = i
    return best


def runs_of(ids: set[int]) -> list[int]:
    """Lengths of the maximal runs of consecutive IDs, sorted."""
    runs: list[int] = []
    prev = None
    for i in sorted(ids):
        if prev is not None and i == prev + 1:
            runs[-1] += 1
        else:
            runs.append(1)
        prev = i
    return sorted(runs)


def group_truth(sched: Any) -> tuple[list[int], list[int], list[int]]:
    """Per KV group, from vLLM's own tables, counts, specs and managers: tail waste (slots
    beyond the computed tokens), held blocks (entries that are not the null block 0) and
    token slots (entries x the tokens per block the group's manager allocates: the spec's
    block size times the decode-context-parallel ranks of a sharded spec).

    A group has token slots only where vLLM's spec maps tokens to the states of a page
    (``tokens_per_state > 0``; ``KVCacheSpec.get_num_kernel_states``): a Mamba page
    (``tokens_per_state`` -1) is one recurrent state whatever its ``block_size``, so its
    group wastes no slots."""
    sizes = [m.block_size for m in sched.kv_cache_manager.coordinator.single_type_managers]
    waste, held, slots_of = [0] * len(sizes), [0] * len(sizes), [0] * len(sizes)
    slots = [g.kv_cache_spec.tokens_per_state > 0
             for g in sched.kv_cache_config.kv_cache_groups]
    get_ids = sched.kv_cache_manager.get_block_ids
    for req in sched.running:
        for g, ids in enumerate(get_ids(req.request_id)):
            if slots[g]:
                waste[g] += max(0, len(ids) * sizes[g] - req.num_computed_tokens)
                slots_of[g] += len(ids) * sizes[g]
            held[g] += sum(b != 0 for b in ids)
    return waste, held, slots_of


def figures_difference(led: Any, sched: Any, free: set[int]) -> str | None:
    """The scrape's figures (free runs, per-group waste and held blocks) against vLLM."""
    runs = runs_of(free)
    if led.free_runs().tolist() != runs:
        return f"free runs: ledger {led.free_runs().tolist()[:8]}, pool {runs[:8]}"
    at_most = [sum(r <= le for r in runs) for le in (1, 4, 64)]
    mine = led.free_runs_at_most((1, 4, 64))
    if mine != at_most:
        return f"free runs at most 1/4/64: ledger {mine}, pool {at_most}"
    truth = group_truth(sched)
    if led.group_figures() != truth:
        return f"group waste/held: ledger {led.group_figures()}, vLLM {truth}"
    return None


def _sample(ids: set[int], n: int = 8) -> list[int]:
    return sorted(ids)[:n]


class PoolCheck:
    """Compares after every ``schedule()`` of ``probed``; counts steps and preemptions."""

    def __init__(self, probed: ProbedTwin) -> None:
        self.probed = probed
        self.sched = probed.scheduler
        self.pool = self.sched.kv_cache_manager.block_pool
        self.steps = 0
        self.preemptions = 0
        sched = self.sched
        original = type(sched).schedule  # the probe's hooked method

        def checked_schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(sched, *args, **kwargs)
            self.steps += 1
            self.preemptions += len(out.preempted_req_ids)
            problem = self.difference()
            if problem is not None:
                raise AssertionError(f"step {self.steps}: {problem}")
            return out

        sched.schedule = checked_schedule

    def difference(self) -> str | None:
        """The first way the ledger differs from the pool right now; None when equal."""
        self.probed.drain()
        led = self.probed.state.ledger
        if not led.synced:
            return "the ledger lost sync"
        free, cached = pool_truth(self.pool)
        arr = led.array()
        led_free = {i for i in range(led.num_blocks) if arr[i] <= wire.STATE_CACHED}
        led_cached = {i for i in range(led.num_blocks) if arr[i] == wire.STATE_CACHED}
        if led_free != free:
            return (f"free set: ledger only {_sample(led_free - free)}, "
                    f"pool only {_sample(free - led_free)}")
        if led_cached != cached:
            return (f"cached set: ledger only {_sample(led_cached - cached)}, "
                    f"pool only {_sample(cached - led_cached)}")
        if (led.free, led.cached) != (len(free), len(cached)):
            return (f"counts: ledger free/cached {led.free}/{led.cached}, "
                    f"pool {len(free)}/{len(cached)}")
        if led.max_contiguous_free() != max_run(free):
            return f"max contiguous free: ledger {led.max_contiguous_free()}, pool {max_run(free)}"
        audit = self.probed.state.audit
        if any(audit.mismatches.values()):
            return f"the audit found vLLM's pool different: {audit.mismatches}"
        return self._tables_difference(led) or figures_difference(led, self.sched, free)

    def _tables_difference(self, led: Any) -> str | None:
        running = {r.request_id: r for r in self.sched.running}
        if set(led.tables) != set(running):
            return (f"running requests: ledger only {sorted(set(led.tables) - set(running))}, "
                    f"vLLM only {sorted(set(running) - set(led.tables))}")
        get_ids = self.sched.kv_cache_manager.get_block_ids
        for rid, req in running.items():
            truth = [list(g) for g in get_ids(rid)]
            mine = led.tables[rid]
            if len(mine) != len(truth):
                return f"request {rid}: ledger has {len(mine)} groups, vLLM {len(truth)}"
            for g, (a, b) in enumerate(zip(mine, truth, strict=True)):
                if a != b:
                    return f"request {rid} group {g} table: ledger {a}, vLLM {b}"
            if led.tokens.get(rid) != req.num_computed_tokens:
                return (f"request {rid} computed tokens: ledger {led.tokens.get(rid)}, "
                        f"vLLM {req.num_computed_tokens}")
        return None


def pairwise(axes: dict[str, tuple[Any, ...]]) -> list[dict[str, Any]]:
    """Rows covering every pair of values of every two axes (greedy, deterministic):
    each new row is the full combination that covers the most pairs not yet covered."""
    names = list(axes)
    uncovered = {
        (a, va, b, vb)
        for a, b in combinations(names, 2)
        for va in axes[a]
        for vb in axes[b]
    }
    rows: list[dict[str, Any]] = []
    candidates = [dict(zip(names, vals, strict=True)) for vals in product(*axes.values())]
    while uncovered:
        best = max(candidates, key=lambda row: len(covered_pairs(row) & uncovered))
        rows.append(best)
        uncovered -= covered_pairs(best)
    return rows


def covered_pairs(row: dict[str, Any]) -> set[tuple[str, Any, str, Any]]:
    return {(a, row[a], b, row[b]) for a, b in combinations(list(row), 2)}


def step_trail(twin: Any) -> tuple[list[tuple[Any, ...]], Any]:
    """``(trail, on_step)``: pass ``on_step`` to ``Twin.run`` and ``trail`` gets, per step,
    what vLLM decided: tokens scheduled per request, each scheduled request's block table
    in every KV cache group, the requests preempted and finished, and the tokens each
    scheduled request has output so far. Two runs that did the same have equal trails."""
    sched = twin.scheduler
    trail: list[tuple[Any, ...]] = []

    def on_step(_i: int, out: Any) -> None:
        live = [rid for rid in sorted(out.num_scheduled_tokens) if rid in sched.requests]
        trail.append((
            tuple(sorted(out.num_scheduled_tokens.items())),
            tuple((rid, tuple(map(tuple, sched.kv_cache_manager.get_block_ids(rid))))
                  for rid in live),
            tuple(sorted(out.preempted_req_ids)),
            tuple(sorted(out.finished_req_ids)),
            tuple((rid, tuple(sched.requests[rid].output_token_ids)) for rid in live),
        ))

    return trail, on_step


def covered(row: dict[str, Any], strength: int) -> set[tuple[tuple[str, Any], ...]]:
    """The value combinations of every ``strength`` axes that ``row`` holds."""
    return {tuple((a, row[a]) for a in names) for names in combinations(list(row), strength)}


def covering(axes: dict[str, tuple[Any, ...]], strength: int,
             have: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """Rows that, with ``have``, hold every combination of values of every ``strength``
    axes (greedy, deterministic, as ``pairwise``)."""
    names = list(axes)
    candidates = [dict(zip(names, vals, strict=True)) for vals in product(*axes.values())]
    uncovered = set().union(*(covered(r, strength) for r in candidates))
    for row in have:
        uncovered -= covered({n: row[n] for n in names}, strength)
    rows: list[dict[str, Any]] = []
    while uncovered:
        best = max(candidates, key=lambda row: len(covered(row, strength) & uncovered))
        rows.append(best)
        uncovered -= covered(best, strength)
    return rows


def head_needs(monkeypatch: pytest.MonkeyPatch, pt_of: Callable[[], ProbedTwin]
               ) -> tuple[ProbedTwin, list[tuple[int, int]], Callable[[int, object], None]]:
    """vLLM's own ``get_num_blocks_to_allocate`` recorded per request at every call (on
    the unitary coordinator's class, before ``pt_of`` builds the probed twin: the probe's
    blocks-needed hook calls what it found), and an ``on_step`` that pairs after each
    step the waiting head's bound with the most vLLM asked the pool for that request."""
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator as coord_cls

    own = coord_cls.get_num_blocks_to_allocate
    sig = inspect.signature(own)
    asked: dict[str, int] = {}

    def recorded(self: object, *args: object, **kw: object) -> int:
        n = own(self, *args, **kw)
        rid = str(sig.bind(self, *args, **kw).arguments["request_id"])
        asked[rid] = max(n, asked.get(rid, 0))
        return n

    monkeypatch.setattr(coord_cls, "get_num_blocks_to_allocate", recorded)
    pt = pt_of()
    assert type(pt.rec.mgr.coordinator) is coord_cls
    checked: list[tuple[int, int]] = []

    def after(_: int, __: object) -> None:
        s = pt.state.last_step
        if s is not None and s.head_req_id in asked:
            checked.append((s.head_blocks_needed, asked[s.head_req_id]))
        asked.clear()

    return pt, checked, after
