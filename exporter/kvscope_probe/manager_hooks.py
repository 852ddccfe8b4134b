"""Wrappers on vLLM's per-group KV cache managers (``SingleTypeKVCacheManager`` and every
override): the two places a manager changes a request's table without the pool seeing
whose table it is. ``_remove_blocks_in_range`` (a sliding window or a Mamba group
replacing blocks by the null block) only sets which table the ``free_blocks`` call inside
it concerns; ``_relocate_speculative_block`` records a block moved to a table's end.
Full attention never calls either. Installed by ``hooks.install``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _nulling(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Mark the table whose blocks ``orig`` replaces by the null block and frees."""

    def _remove_blocks_in_range(self: Any, request_id: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self.block_pool._kvscope
        if rec is None or not rec.enabled:
            return orig(self, request_id, *args, **kwargs)
        outer = rec.null_ctx
        rec.null_ctx = (request_id, self.kv_cache_group_id)
        try:
            return orig(self, request_id, *args, **kwargs)
        finally:
            rec.null_ctx = outer

    return _remove_blocks_in_range


def _relocating(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Record a block that ``orig`` moves to the end of a request's table."""

    def _relocate_speculative_block(self: Any, req_blocks: Any, block_idx: int) -> Any:
        ret = orig(self, req_blocks, block_idx)
        rec = self.block_pool._kvscope
        if rec is not None and rec.enabled:
            try:
                rec.on_relocate(self, req_blocks, block_idx)
            except Exception as exc:  # noqa: BLE001
                rec.fault("_relocate_speculative_block", exc)
        return ret

    return _relocate_speculative_block


def manager_hooks(base: Any) -> None:
    """Wrap ``_remove_blocks_in_range`` on the base manager and every override of it, and
    ``_relocate_speculative_block`` where a manager has one."""
    todo, seen = [base], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        if callable(cls.__dict__.get("_remove_blocks_in_range")):
            cls._remove_blocks_in_range = _nulling(cls.__dict__["_remove_blocks_in_range"])
        if callable(cls.__dict__.get("_relocate_speculative_block")):
            cls._relocate_speculative_block = _relocating(
                cls.__dict__["_relocate_speculative_block"])
