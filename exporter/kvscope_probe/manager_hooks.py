"""Wrappers on vLLM's per-group KV cache managers (``SingleTypeKVCacheManager`` and every
override): the two places a manager changes a request's table without the pool seeing
whose table it is. ``_remove_blocks_in_range`` (a sliding window or a Mamba group
replacing blocks by the null block) only sets which table the ``free_blocks`` call inside
it concerns; ``_relocate_speculative_block`` records a block moved to a table's end.
Full attention never calls either. Installed by ``hooks.install``.
"""

from __future__ import annotations

from typing import Any

from kvscope_probe import guard


def _rec_of_manager(args: tuple[Any, ...]) -> Any:
    """A manager reaches its Recorder through its pool."""
    return args[0].block_pool._kvscope


def _null_ctx_on(rec: Any, a: Any, k: Any) -> Any:
    """Mark the table whose blocks vLLM replaces by the null block and frees; return
    the mark it replaces (restored after)."""
    outer = rec.null_ctx
    rec.null_ctx = (guard.arg(a, k, 1, "request_id"), a[0].kv_cache_group_id)
    return outer


def _null_ctx_off(rec: Any, a: Any, k: Any, ret: Any, outer: Any) -> None:
    rec.null_ctx = outer


def _null_ctx_raised(rec: Any, a: Any, k: Any, outer: Any) -> None:
    _null_ctx_off(rec, a, k, None, outer)  # vLLM raised: the mark restored all the same


def _relocated(rec: Any, a: Any, k: Any, ret: Any, st: Any) -> None:
    """Record a block that vLLM moved to the end of a request's table."""
    rec.on_relocate(a[0], guard.arg(a, k, 1, "req_blocks"), guard.arg(a, k, 2, "block_idx"))


def manager_hooks(base: Any, *, nulling: bool = True, relocating: bool = True) -> None:
    """Wrap ``_remove_blocks_in_range`` on the base manager and every override of it, and
    ``_relocate_speculative_block`` where a manager has one (each unless switched off:
    ``fingerprint``)."""
    todo, seen = [base], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        if nulling and callable(cls.__dict__.get("_remove_blocks_in_range")):
            guard.install(cls, "_remove_blocks_in_range", rec_of=_rec_of_manager,
                          before=_null_ctx_on, after=_null_ctx_off, undo=_null_ctx_raised,
                          timed=False)
        if relocating and callable(cls.__dict__.get("_relocate_speculative_block")):
            guard.install(cls, "_relocate_speculative_block", rec_of=_rec_of_manager,
                          after=_relocated)
