"""Wrappers around the vLLM methods the probe observes, installed at class level.

Every wrapper is made by ``guard.install``: vLLM's original gets its arguments and
returns its result unchanged, and kvscope's work before and after it (finding or
attaching the Recorder included) runs inside one guard that counts a fault and never
re-raises. A class attribute
``_kvscope = None`` makes the "not recording" path a plain attribute read.

Observed:
- ``Scheduler.__init__`` (attach at once), ``schedule`` (per-step record), ``shutdown``
  (the sender flushes and ends before vLLM's method runs: ``EngineCore.shutdown`` calls it),
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
from typing import TYPE_CHECKING, Any

from kvscope_probe import guard
from kvscope_probe.manager_hooks import manager_hooks
from kvscope_probe.wire import OP_ALLOC

if TYPE_CHECKING:  # recorder -> calibrate -> hooks: no import back at run time
    from kvscope_probe.recorder import Recorder

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
    "vllm.v1.core.sched.scheduler:Scheduler": ("add_request", "_free_request", "shutdown"),
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


class _Pending:
    """What ``Scheduler.__init__``'s hook reads as its Recorder: the real one is
    attached after vLLM's ``__init__`` has run (``after``)."""

    enabled = True


_PENDING = _Pending()


def _attaching(attach: Callable[[Any], Recorder | None]) -> Callable[..., Any]:
    """``rec_of`` for the scheduler's entry points: attach at the first call."""

    def rec_of(args: tuple[Any, ...]) -> Any:
        rec = args[0]._kvscope
        return attach(args[0]) if rec is None else rec

    return rec_of


def _scheduler_hooks(cls: Any, attach: Callable[[Any], Recorder | None],
                     off: dict[str, str] | None = None) -> None:
    off = off or {}
    cls._kvscope = None
    # Attach as soon as the engine has a scheduler, not at its first step: an engine
    # that has served nothing yet says hello and sends heartbeats, so the sidecar
    # (and a pod's readiness) sees it before any traffic.
    guard.install(cls, "__init__", name="Scheduler.__init__", rec_of=lambda a: _PENDING,
                  after=lambda rec, a, k, ret, st: attach(a[0]), timed=False)
    attaching = _attaching(attach)

    def before_schedule(rec: Recorder, a: Any, k: Any) -> int:
        rec.in_schedule = True
        return _now_ns()

    def after_schedule(rec: Recorder, a: Any, k: Any, out: Any, t0: int) -> None:
        rec.in_schedule = False
        t1 = _now_ns()
        rec.on_step(out, t1 - t0, t1)

    def schedule_raised(rec: Recorder, a: Any, k: Any, t0: int) -> None:
        # What the failed call moved in the pool stays in ``ops``: the next step's
        # record carries it.
        rec.in_schedule = False

    guard.install(cls, "schedule", name="Scheduler.schedule", rec_of=attaching,
                  before=before_schedule, after=after_schedule, undo=schedule_raised,
                  timed=False)
    guard.install(cls, "_preempt_request", name="Scheduler._preempt_request",
                  before=lambda rec, a, k: rec.on_preempt(guard.arg(a, k, 1, "request")))
    if "ends" not in off and callable(getattr(cls, "_free_request", None)):
        guard.install(cls, "_free_request", name="Scheduler._free_request",
                      before=lambda rec, a, k: rec.on_end(guard.arg(a, k, 1, "request")))
    if "shutdown" not in off and callable(getattr(cls, "shutdown", None)):
        # vLLM's EngineCore.shutdown() calls it: the sender flushes and ends as it begins,
        # so a shutdown of vLLM's that raises (a KV connector's) leaves no sender behind.
        guard.install(cls, "shutdown", name="Scheduler.shutdown",
                      before=lambda rec, a, k: rec.close(), timed=False)
    if "arrivals" not in off and callable(getattr(cls, "add_request", None)):
        def known(rec: Recorder, a: Any, k: Any) -> bool:
            return guard.arg(a, k, 1, "request").request_id in a[0].requests

        def arrived(rec: Recorder, a: Any, k: Any, ret: Any, was_known: bool) -> None:
            if not was_known:
                rec.on_arrival(guard.arg(a, k, 1, "request"))

        guard.install(cls, "add_request", name="Scheduler.add_request", rec_of=attaching,
                      before=known, after=arrived)


def _taken(rec: Recorder, a: Any, k: Any) -> list[Any]:
    """Blocks ``touch`` takes off the free queue: ref_cnt 0 before it runs."""
    return [b for b in guard.arg(a, k, 1, "blocks") if b.ref_cnt == 0 and not b.is_null]


def _new_blocks(rec: Recorder, a: Any, k: Any, ret: Any, st: Any) -> None:
    # The IDs read now, at C level, while vLLM has just touched these blocks: read at
    # the step's end instead, each block is a cache miss or three.
    if ret:
        rec.allocs += 1
        rec.ops.append((OP_ALLOC, [ret[0].block_id] if len(ret) == 1  # most calls
                        else list(map(_block_id, ret))))


def _pool_hooks(cls: Any, registry: dict[str, guard.Hook] | None = None,
               off: dict[str, str] | None = None) -> None:
    """The BlockPool wrappers (``registry``: where calibrate.py's stand-ins go; ``off``:
    features not recorded)."""
    uncache = "uncache" not in (off or {})
    def on(attr: str, **kw: Any) -> None:
        guard.install(cls, attr, name=f"BlockPool.{attr}", registry=registry, **kw)

    on("touch", before=_taken, materialize=(1, "blocks"),
       after=lambda rec, a, k, ret, taken: taken and rec.on_alloc(taken))
    on("get_new_blocks", after=_new_blocks, timed=False)
    for attr, param in (("free_blocks", "ordered_blocks"), ("unpin_blocks", "blocks")):
        on(attr, materialize=(1, param),
           after=lambda rec, a, k, ret, st, p=param: rec.on_free(guard.arg(a, k, 1, p)))
    if uncache and callable(getattr(cls, "evict_blocks", None)):
        on("evict_blocks", materialize=(1, "block_ids"),
           after=lambda rec, a, k, ret, st: rec.on_uncache(guard.arg(a, k, 1, "block_ids")))
    if uncache and callable(getattr(cls, "reset_prefix_cache", None)):
        on("reset_prefix_cache", after=lambda rec, a, k, ok, st: ok and rec.on_uncache_all())
    cls._kvscope = None


DISABLED: dict[str, str] = {}
"""{feature: why} the fingerprint switched off at install (``fingerprint.check``)."""


def install(attach: Callable[[Any], Recorder | None],
            off: dict[str, str] | None = None) -> list[str]:
    """Patch vLLM's classes once, leaving out the hooks of the features in ``off``
    (``fingerprint.check``); return the optional hooks that were not found."""
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
    off = dict(off or {})
    DISABLED.clear()
    DISABLED.update(off)
    _pool_hooks(_resolve("vllm.v1.core.block_pool:BlockPool"), off=off)
    managers = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager"
    if not any(a.startswith(managers) for a in absent):
        manager_hooks(_resolve(managers), nulling="null_tables" not in off,
                      relocating="relocate" not in off)
    _scheduler_hooks(sched_cls, attach, off=off)
    sched_cls._kvscope_installed = True
    return absent
