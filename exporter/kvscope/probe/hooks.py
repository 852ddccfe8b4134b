"""Wrappers around the vLLM methods the probe observes, installed at class level.

Each wrapper calls vLLM's original first or last as the fact requires, and contains
every exception of its own: the probe never raises into vLLM. A class attribute
``_kvscope = None`` makes the "not recording" path a plain attribute read.

Observed:
- ``Scheduler.schedule`` (per-step record), ``_preempt_request`` (facts before the
  blocks are freed), ``add_request`` (arrival), ``_free_request`` (finish / abort);
- ``BlockPool.get_new_blocks``, ``touch``, ``free_blocks``, ``unpin_blocks``: the only
  four methods that move a block between free and used; ``evict_blocks`` and
  ``reset_prefix_cache`` change whether a free block still holds prefix-cache data;
- ``KVCacheCoordinator.get_num_blocks_to_allocate``: how many blocks the allocation
  that is about to fail needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvscope.probe.recorder import Recorder

_now_ns = time.perf_counter_ns

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


def _scheduler_hooks(cls: Any, attach: Callable[[Any], Recorder | None]) -> None:
    o_schedule, o_preempt = cls.schedule, cls._preempt_request

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

    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self._kvscope
        if rec is not None and rec.enabled:
            try:
                rec.on_preempt(request)
            except Exception as exc:  # noqa: BLE001
                rec.fault("_preempt_request", exc)
        return o_preempt(self, request, *args, **kwargs)

    cls.schedule, cls._preempt_request = schedule, _preempt_request
    cls._kvscope = None

    if callable(getattr(cls, "add_request", None)):
        o_add = cls.add_request

        def add_request(self: Any, request: Any) -> Any:
            known = request.request_id in self.requests
            ret = o_add(self, request)
            rec = self._kvscope
            if rec is None and not known:
                rec = attach(self)
            if rec is not None and rec.enabled and not known:
                try:
                    rec.on_arrival(request)
                except Exception as exc:  # noqa: BLE001
                    rec.fault("add_request", exc)
            return ret

        cls.add_request = add_request

    if callable(getattr(cls, "_free_request", None)):
        o_free_req = cls._free_request

        def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self._kvscope
            if rec is not None and rec.enabled:
                try:
                    rec.on_end(request)
                except Exception as exc:  # noqa: BLE001
                    rec.fault("_free_request", exc)
            return o_free_req(self, request, *args, **kwargs)

        cls._free_request = _free_request


def _pool_hooks(cls: Any) -> None:
    o_new, o_touch = cls.get_new_blocks, cls.touch
    o_free, o_unpin = cls.free_blocks, cls.unpin_blocks

    def get_new_blocks(self: Any, num_blocks: int) -> Any:
        ret = o_new(self, num_blocks)
        rec = self._kvscope
        if rec is not None and rec.enabled:
            try:
                rec.on_alloc(ret)
            except Exception as exc:  # noqa: BLE001
                rec.fault("get_new_blocks", exc)
        return ret

    def touch(self: Any, blocks: Any) -> Any:
        rec = self._kvscope
        if rec is not None and rec.enabled:
            try:
                taken = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
            except Exception as exc:  # noqa: BLE001
                rec.fault("touch", exc)
                taken = []
            ret = o_touch(self, blocks)
            if taken:
                try:
                    rec.on_alloc(taken)
                except Exception as exc:  # noqa: BLE001
                    rec.fault("touch", exc)
            return ret
        return o_touch(self, blocks)

    def free_blocks(self: Any, ordered_blocks: Any) -> Any:
        rec = self._kvscope
        if rec is None or not rec.enabled:
            return o_free(self, ordered_blocks)
        blocks = list(ordered_blocks)
        ret = o_free(self, blocks)
        try:
            rec.on_free(blocks)
        except Exception as exc:  # noqa: BLE001
            rec.fault("free_blocks", exc)
        return ret

    def unpin_blocks(self: Any, blocks: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self._kvscope
        if rec is None or not rec.enabled:
            return o_unpin(self, blocks, *args, **kwargs)
        blocks = list(blocks)
        ret = o_unpin(self, blocks, *args, **kwargs)
        try:
            rec.on_free(blocks)
        except Exception as exc:  # noqa: BLE001
            rec.fault("unpin_blocks", exc)
        return ret

    cls.get_new_blocks, cls.touch = get_new_blocks, touch
    cls.free_blocks, cls.unpin_blocks = free_blocks, unpin_blocks
    cls._kvscope = None

    if callable(getattr(cls, "evict_blocks", None)):
        o_evict = cls.evict_blocks

        def evict_blocks(self: Any, block_ids: Any) -> Any:
            ret = o_evict(self, block_ids)
            rec = self._kvscope
            if rec is not None and rec.enabled:
                try:
                    rec.on_uncache(block_ids)
                except Exception as exc:  # noqa: BLE001
                    rec.fault("evict_blocks", exc)
            return ret

        cls.evict_blocks = evict_blocks

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


def _coordinator_hooks(cls: Any) -> None:
    o_need = cls.get_num_blocks_to_allocate

    def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        n = o_need(self, *args, **kwargs)
        rec = self._kvscope
        if rec is not None:
            rec.need = (kwargs["request_id"] if "request_id" in kwargs else args[0], n)
        return n

    cls.get_num_blocks_to_allocate = get_num_blocks_to_allocate
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
    _scheduler_hooks(sched_cls, attach)
    try:
        _coordinator_hooks(_resolve("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator"))
    except Exception:  # noqa: BLE001 - reasons degrade to "unknown", blocks_needed to None
        pass
    sched_cls._kvscope_installed = True
    return absent
