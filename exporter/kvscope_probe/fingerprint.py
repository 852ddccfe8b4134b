"""What the probe relies on in vLLM, checked at attach: one entry per feature.

Each feature lists the methods it wraps, with the parameters its hooks read (by name at
a position, as ``guard.arg`` reads them, so each must be positional-or-keyword there),
and the class fields it reads. vLLM 0.32 and 0.33 match every entry (``KNOWN``); any
other version is held to the same structural check, so what does not match is not
recorded rather than recorded on a guess. A mismatch in ``core`` keeps the probe out
entirely; any other feature is switched off alone and named in the hello's ``disabled``.

Instance attributes that only exist once vLLM's ``__init__`` has run (``requests``,
``kv_holding_waiting``) are checked at attach on the scheduler itself (``instance``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from kvscope_probe.identity import kv_managers

KNOWN = ("0.32", "0.33")
"""vLLM minor versions whose sources this fingerprint was read from (all entries match)."""

SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
POOL = "vllm.v1.core.block_pool:BlockPool"
BLOCK = "vllm.v1.core.kv_cache_utils:KVCacheBlock"
COORD = "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator"
MANAGER = "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager"

# (class path, method, ((position after self, name), ...)) and (class path, field names).
METHODS: dict[str, tuple[tuple[str, str, tuple[tuple[int, str], ...]], ...]] = {
    "core": (
        (SCHED, "schedule", ()),
        (SCHED, "_preempt_request", ((1, "request"),)),
        (POOL, "get_new_blocks", ()),
        (POOL, "touch", ((1, "blocks"),)),
        (POOL, "free_blocks", ((1, "ordered_blocks"),)),
        (POOL, "unpin_blocks", ((1, "blocks"),)),
        (POOL, "get_num_free_blocks", ()),
    ),
    "arrivals": ((SCHED, "add_request", ((1, "request"),)),),
    "ends": ((SCHED, "_free_request", ((1, "request"),)),),
    "uncache": ((POOL, "evict_blocks", ((1, "block_ids"),)),
                (POOL, "reset_prefix_cache", ())),
    "need": ((COORD, "get_num_blocks_to_allocate", ((1, "request_id"),)),),
    "null_tables": ((MANAGER, "_remove_blocks_in_range", ((1, "request_id"),)),),
    "shutdown": ((SCHED, "shutdown", ()),),
}
FIELDS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "core": ((BLOCK, ("block_id", "ref_cnt", "is_null", "pool")),),
    "hash_field": ((BLOCK, ("_block_hash",)),),
}
RELOCATE = ("_relocate_speculative_block", ((1, "req_blocks"), (2, "block_idx")))
"""Defined on a manager subclass (Mamba's), not on the base: checked on every subclass."""
INSTANCE = {"core": "requests", "kv_holding": "kv_holding_waiting"}
"""Scheduler attributes vLLM's ``__init__`` sets, checked on the scheduler at attach."""

FEATURES = ("core", "arrivals", "ends", "uncache", "need", "null_tables", "relocate",
            "hash_field", "kv_holding", "shutdown")
"""Every feature, in the order the sidecar exports them."""

_POK = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)


def resolve(path: str) -> Any:
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def _method(cls: Any, attr: str, params: tuple[tuple[int, str], ...]) -> str | None:
    """Why ``cls.attr`` does not fit the hooks; None when it does."""
    fn = getattr(cls, attr, None)
    if not callable(fn):
        return f"{cls.__name__}.{attr} missing"
    try:
        sig = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return f"{cls.__name__}.{attr} has no readable signature"
    for i, name in params:
        got = sig[i] if len(sig) > i else None
        if got is None or got.name != name or got.kind not in _POK:
            seen = got.name if got is not None else "nothing"
            return f"{cls.__name__}.{attr} parameter {i} is {seen}, not {name}"
    return None


def _fields(cls: Any, names: tuple[str, ...]) -> str | None:
    have = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    gone = [n for n in names if n not in have and not hasattr(cls, n)]
    return f"{cls.__name__} lacks {', '.join(gone)}" if gone else None


def hash_is_field(cls: Any) -> bool:
    """``block_hash`` is a property that reads the dataclass field ``_block_hash``: tried
    on a fresh block of ``cls`` (a plain dataclass, nothing of vLLM's state)."""
    prop = next((c.__dict__["block_hash"] for c in getattr(cls, "__mro__", ())
                 if "block_hash" in c.__dict__), None)
    if not isinstance(prop, property) or "_block_hash" not in getattr(
            cls, "__dataclass_fields__", {}):
        return False
    try:
        block, mark = cls(block_id=0), ("kvscope-fingerprint",)
        block._block_hash = mark
        return block.block_hash is mark
    except Exception:  # noqa: BLE001 - any surprise means "not the field we know"
        return False


def check(classes: Mapping[str, Any] | None = None,
          resolver: Callable[[str], Any] = resolve) -> dict[str, str]:
    """{feature: why it is off} for the installed vLLM (``classes`` overrides the
    classes by path, for tests). Empty: everything matches."""
    classes = classes or {}
    off: dict[str, str] = {}

    def cls_of(path: str) -> Any:
        return classes[path] if path in classes else resolver(path)

    def note(feature: str, why: str | None) -> None:
        if why is not None and feature not in off:
            off[feature] = why

    for feature, entries in METHODS.items():
        for path, attr, params in entries:
            try:
                note(feature, _method(cls_of(path), attr, params))
            except Exception as exc:  # noqa: BLE001 - an import failure means "absent"
                note(feature, f"{path} not importable ({type(exc).__name__})")
    for feature, fentries in FIELDS.items():
        for path, names in fentries:
            try:
                note(feature, _fields(cls_of(path), names))
            except Exception as exc:  # noqa: BLE001
                note(feature, f"{path} not importable ({type(exc).__name__})")
    try:
        if "hash_field" not in off and not hash_is_field(cls_of(BLOCK)):
            off["hash_field"] = "KVCacheBlock.block_hash is not a property over _block_hash"
        note("relocate", _relocate(cls_of(MANAGER)))
    except Exception as exc:  # noqa: BLE001
        note("relocate", f"{MANAGER} not importable ({type(exc).__name__})")
    return off


def _relocate(base: Any) -> str | None:
    """Every manager class defining ``_relocate_speculative_block`` fits the hook, and
    at least one does."""
    attr, params = RELOCATE
    todo, seen, found = [base], set(), False
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        if attr in cls.__dict__:
            found = True
            why = _method(cls, attr, params)
            if why is not None:
                return why
    return None if found else f"no KV cache manager defines {attr}"


def instance(sched: Any) -> dict[str, str]:
    """{feature: why it is off} for attributes of one scheduler."""
    off = {f: f"Scheduler has no {a}" for f, a in INSTANCE.items()
           if getattr(sched, a, None) is None}
    foreign = _foreign_manager(sched)
    if foreign and "core" not in off:
        off["core"] = foreign
    return off


def _foreign_manager(sched: Any) -> str:
    """Why a KV cache manager's blocks are not the scheduler's pool's alone ("" when
    they are): vLLM 0.33's HiSparse binds a manager to a host pool of its own, and keeps
    pages it released to the pool in the request's table (``residency_changes``). The
    probe mirrors one pool and reads tables as the blocks each request holds there."""
    mgr = getattr(sched, "kv_cache_manager", None)
    pool = getattr(mgr, "block_pool", None)
    for m in kv_managers(mgr):
        name = type(m).__name__
        if getattr(m, "block_pool", pool) is not pool:
            return f"{name} allocates from a pool of its own, not the scheduler's"
        if hasattr(m, "residency_changes"):
            return (f"{name} keeps released pages in its tables (residency_changes): "
                    "a table is not the blocks its request holds")
    return ""


def line(off: Mapping[str, str], version: str) -> str:
    """The one log line naming what is not recorded and why."""
    known = ".".join(version.split(".")[:2]) in KNOWN
    where = f"vLLM {version}" + ("" if known else f" (fingerprinted: {' and '.join(KNOWN)})")
    parts = "; ".join(f"{f}: {why}" for f, why in off.items())
    if "core" in off:
        return f"kvscope probe disabled on {where}: {parts}"
    return f"kvscope probe: {where}: not recording {', '.join(off)} ({parts})"
