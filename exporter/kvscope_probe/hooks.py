"""Wrappers around the vLLM methods the probe observes, installed at class level.

Each wrapper calls vLLM's original first or last as the fact requires, and contains
every exception of its own: the probe never raises into vLLM. A class attribute
``_kvscope = None`` makes the "not recording" path a plain attribute read.

Observed:
- ``Scheduler.__init__`` (attach at once), ``schedule`` (per-step record),
  ``_preempt_request`` (facts before the
  blocks are freed), ``add_request`` (arrival), ``_free_request`` (finish / abort);
- ``BlockPool.get_new_blocks``, ``touch``, ``free_blocks``, ``unpin_blocks``: the only
  four methods that move a block between free and used; ``evict_blocks`` and
  ``reset_prefix_cache`` change whether a free block still holds prefix-cache data;
- ``KVCacheCoordinator.get_num_blocks_to_allocate``: how many blocks the allocation
  that is about to fail needs; wrapped per instance, only while the pool is low
  (``Recorder.watch_need``, ``needhook``);
- ``SingleTypeKVCacheManager._remove_blocks_in_range`` (and its overrides): a sliding
  window (or a Mamba group) replacing a request's blocks by the null block; it only sets
  which table the ``free_blocks`` call inside it concerns. Full attention never calls it
  (``manager_hooks``).

Time spent in the handlers the wrappers call is added to ``Recorder.wrap_ns`` and
reported with the next step; the call layers themselves, the ``get_new_blocks`` wrapper
(one append of its blocks' IDs, read at C level)
and the blocks-needed hook are not timed (a clock read costs more than they do): the step
record adds them as calls x a cost measured at attach (``calibrate``);
benchmarks/probe_micro.py measures them all (``engine``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from kvscope_probe.manager_hooks import manager_hooks
from kvscope_probe.recorder import Recorder
from kvscope_probe.wire import OP_ALLOC

_now_ns = time.perf_counter_ns
_block_id = attrgetter("block_id")

REQUIRED = {
    "vllm.v1.core.sched.scheduler:Scheduler": ("schedule", "_preempt_request"),
    "vllm.v1.core.block_pool:BlockPool": (
        "get_new_blocks",
        "touch",
        "free_blocks",
        "unpin_blocks",
        "get_num_free_blocks",
    ),
}
OPTIONAL = {
    "vllm.v1.core.sched.scheduler:Scheduler": ("add_request", "_free_request"),
    "vllm.v1.core.block_pool:BlockPool": ("evict_blocks", "reset_prefix_cache"),
    "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator": ("get_num_blocks_to_allocate",),
    "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager": (
        "_remove_blocks_in_range",),
}


def _resolve(path: str) -> Any:
    import importlib

    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def missing_members() -> list[str]:
    """Required classes or methods absent from the installed vLLM."""
    missing = []
    for path, names in REQUIRED.items():
        try:
            cls = _resolve(path)
        except Exception as exc:  # noqa: BLE001 - any import failure means "absent"
            missing.append(f"{path} ({type(exc).__name__})")
            continue
        missing += [f"{path}.{n}" for n in names if not callable(getattr(cls, n, None))]
    return missing


def _before(orig: Callable[..., Any], handler: str) -> Callable[..., Any]:
    """Record facts about the first argument, then call vLLM's method."""

    def wrapper(self: Any, arg: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self._kvscope
        if rec is not None and rec.enabled:
            t = _now_ns()
            try:
                getattr(rec, handler)(arg)
            except Exception as exc:  # noqa: BLE001
                rec.fault(orig.__name__, exc)
            rec.wrap_ns += _now_ns() - t
        return orig(self, arg, *args, **kwargs)

    return wrapper


def _after(orig: Callable[..., Any], handler: str, *, result: bool) -> Callable[..., Any]:
    """Call vLLM's method, then record its result (or its first argument, materialised
    first so an iterator is not consumed twice)."""

    def wrapper(self: Any, arg: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self._kvscope
        if rec is None or not rec.enabled:
            return orig(self, arg, *args, **kwargs)
        t0 = _now_ns()
        if not result:
            arg = list(arg)
        t1 = _now_ns()
        ret = orig(self, arg, *args, **kwargs)
        t = _now_ns()
        try:
            getattr(rec, handler)(ret if result else arg)
        except Exception as exc:  # noqa: BLE001
            rec.fault(orig.__name__, exc)
        rec.wrap_ns += _now_ns() - t + t1 - t0  # the copy and the handler, not vLLM's call
        return ret

    return wrapper


def _scheduler_hooks(cls: Any, attach: Callable[[Any], Recorder | None]) -> None:
    o_schedule = cls.schedule
    o_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        o_init(self, *args, **kwargs)
        # Attach as soon as the engine has a scheduler, not at its first step: an engine
        # that has served nothing yet says hello and sends heartbeats, so the sidecar
        # (and a pod's readiness) sees it before any traffic.
        try:
            attach(self)
        except Exception:  # noqa: BLE001 - attach contains its own errors; never raise here
            pass

    cls.__init__ = __init__

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self._kvscope
        if rec is None:
            rec = attach(self)
        if rec is None or not rec.enabled:
            return o_schedule(self, *args, **kwargs)
        rec.in_schedule = True
        t0 = _now_ns()
        try:
            out = o_schedule(self, *args, **kwargs)
        finally:
            rec.in_schedule = False
        t1 = _now_ns()
        try:
            rec.on_step(out, t1 - t0, t1)
        except Exception as exc:  # noqa: BLE001
            rec.fault("schedule", exc)
        return out

    cls.schedule = schedule
    cls._preempt_request = _before(cls._preempt_request, "on_preempt")
    cls._kvscope = None
    if callable(getattr(cls, "_free_request", None)):
        cls._free_request = _before(cls._free_request, "on_end")
    if callable(getattr(cls, "add_request", None)):
        o_add = cls.add_request

        def add_request(self: Any, request: Any) -> Any:
            known = request.request_id in self.requests
            ret = o_add(self, request)
            if known:
                return ret
            rec = self._kvscope
            if rec is None:
                rec = attach(self)
            if rec is not None and rec.enabled:
                try:
                    rec.on_arrival(request)
                except Exception as exc:  # noqa: BLE001
                    rec.fault("add_request", exc)
            return ret

        cls.add_request = add_request


def _pool_hooks(cls: Any) -> None:
    o_touch = cls.touch

    def touch(self: Any, blocks: Any) -> Any:
        rec = self._kvscope
        if rec is None or not rec.enabled:
            return o_touch(self, blocks)
        t = _now_ns()
        try:  # blocks leaving the free queue: ref_cnt 0 before the touch
            taken = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
        except Exception as exc:  # noqa: BLE001
            rec.fault("touch", exc)
            taken = []
        t1 = _now_ns()
        ret = o_touch(self, blocks)
        t2 = _now_ns()
        if taken:
            try:
                rec.on_alloc(taken)
            except Exception as exc:  # noqa: BLE001
                rec.fault("touch", exc)
        rec.wrap_ns += _now_ns() - t2 + t1 - t
        return ret

    cls.touch = touch
    o_new = cls.get_new_blocks

    def get_new_blocks(self: Any, num_blocks: Any, *args: Any, **kwargs: Any) -> Any:
        ret = o_new(self, num_blocks, *args, **kwargs)
        rec = self._kvscope
        if ret and rec is not None and rec.enabled:
            # The IDs read now, at C level, while vLLM has just touched these blocks: read
            # at the step's end instead, each block is a cache miss or three (measured in
            # place: 4.1 us a step to settle 7 allocations at 187 requests).
            rec.allocs += 1
            rec.ops.append((OP_ALLOC, [ret[0].block_id] if len(ret) == 1  # most calls
                            else list(map(_block_id, ret))))
        return ret

    cls.get_new_blocks = get_new_blocks
    cls.free_blocks = _after(cls.free_blocks, "on_free", result=False)
    cls.unpin_blocks = _after(cls.unpin_blocks, "on_free", result=False)
    if callable(getattr(cls, "evict_blocks", None)):
        cls.evict_blocks = _after(cls.evict_blocks, "on_uncache", result=False)
    if callable(getattr(cls, "reset_prefix_cache", None)):
        o_reset = cls.reset_prefix_cache

        def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
            ok = o_reset(self, *args, **kwargs)
            rec = self._kvscope
            if ok and rec is not None and rec.enabled:
                try:
                    rec.on_uncache_all()
                except Exception as exc:  # noqa: BLE001
                    rec.fault("reset_prefix_cache", exc)
            return ok

        cls.reset_prefix_cache = reset_prefix_cache
    cls._kvscope = None


def install(attach: Callable[[Any], Recorder | None]) -> list[str]:
    """Patch vLLM's classes once; return the optional hooks that were not found."""
    sched_cls = _resolve("vllm.v1.core.sched.scheduler:Scheduler")
    if getattr(sched_cls, "_kvscope_installed", False):
        return []
    absent = []
    for path, names in OPTIONAL.items():
        try:
            cls = _resolve(path)
        except Exception:  # noqa: BLE001
            absent.append(path)
            continue
        absent += [f"{path}.{n}" for n in names if not callable(getattr(cls, n, None))]
    _pool_hooks(_resolve("vllm.v1.core.block_pool:BlockPool"))
    managers = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager"
    if not any(a.startswith(managers) for a in absent):
        manager_hooks(_resolve(managers))
    _scheduler_hooks(sched_cls, attach)
    sched_cls._kvscope_installed = True
    return absent
