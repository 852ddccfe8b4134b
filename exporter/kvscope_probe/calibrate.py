"""What the probe's untimed call layers cost on this machine, measured once per process.

The ``get_new_blocks`` wrapper (one append of its blocks' IDs) and the blocks-needed hook
cost less than the two clock reads that would time them, so they are not timed; the step
record adds ``calls x cost`` for them instead (``Recorder.on_step``), with the cost measured here at
attach time: the probe's own wrapper code around a stand-in that does nothing, against
the stand-in called directly, fastest of a few passes (about 1 ms, once). The figure is
an estimate: benchmarks/probe_micro.py compares the self-report with a replay.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

_now = time.perf_counter_ns
_costs: tuple[float, float] | None = None
CALLS = 200
PASSES = 7


def layer_costs(need_fn: Any = None) -> tuple[float, float]:
    """(ns per ``get_new_blocks`` wrapper call, ns per armed blocks-needed hook call)
    over vLLM's own; ``need_fn`` is vLLM's method (None: the one installed, if any).
    (0, 0) when they cannot be measured: the report then counts only what it times."""
    global _costs
    if _costs is None:
        try:
            _costs = (max(0.0, _alloc_ns()), max(0.0, _need_ns(need_fn)))
        except Exception:  # noqa: BLE001 - an estimate must never stop the probe
            _costs = (0.0, 0.0)
    return _costs


def _pass(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    t0 = _now()
    for _ in range(CALLS):
        fn(*args, **kwargs)
    return (_now() - t0) / CALLS


def _overhead(wrapped: Any, w_args: tuple[Any, ...], raw: Any, r_args: tuple[Any, ...],
              **kwargs: Any) -> float:
    """Fastest pass of ``wrapped`` minus fastest pass of ``raw``, the passes alternating so
    that a busy moment of the machine falls on both (measured one after the other, a busy
    spell during the raw passes only read the hook as costing nothing)."""
    best_w = best_r = float("inf")
    for _ in range(PASSES):
        best_w = min(best_w, _pass(wrapped, w_args, kwargs))
        best_r = min(best_r, _pass(raw, r_args, kwargs))
    return best_w - best_r


def _alloc_ns() -> float:
    from kvscope_probe import hooks

    class Pool:
        ret = [SimpleNamespace(block_id=1)]  # vLLM returns one block a call, mostly

        def get_new_blocks(self, num_blocks: int) -> Any:
            return self.ret

        def touch(self, blocks: Any) -> None: ...

        def free_blocks(self, ordered_blocks: Any) -> None: ...

        def unpin_blocks(self, blocks: Any, on_reuse: Any = None) -> None: ...

    raw = Pool.get_new_blocks
    hooks._pool_hooks(Pool, registry={})  # not vLLM's: not in REGISTRY
    pool = Pool()
    rec = SimpleNamespace(enabled=True, ops=[], allocs=0)
    pool._kvscope = rec  # type: ignore[attr-defined]
    return _overhead(pool.get_new_blocks, (1,), raw, (pool, 1))


def _need_ns(o_need: Any) -> float:
    from kvscope_probe.needhook import need_hook, stand_in

    if o_need is None:
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

        o_need = KVCacheCoordinator.get_num_blocks_to_allocate
    stub, kwargs = stand_in(o_need)
    hook = need_hook(stub, None, SimpleNamespace(need=None))
    return _overhead(hook, (), stub, (None,), **kwargs)
