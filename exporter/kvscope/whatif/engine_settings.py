"""A recorded engine's settings for the twin, from its hello as the store keeps it
(table ``engine_configs``): what ``kvscope explain --counterfactual engine`` replays the
window under, with nothing typed by hand.

The pool (blocks, block size), the scheduler's limits (max_num_seqs, the token budget,
max_model_len, policy, prefix caching), its kind (``AsyncScheduler`` or not) and the
speculative tokens come across as they are. The KV layout must be one the twin builds
(``kvscope.twin.kv_layout``), group for group: the kinds of the engine's KV cache groups in
order, one block size, one sliding window. Anything else is refused with the reason, never
matched to the nearest layout: a Gemma 3 of five sliding-window groups and one full group
allocates six tables a request where the twin's ``full+sliding`` allocates three, and a
replay under it would answer for another engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvscope.models.config import MAX_POSITION_EMBEDDINGS

LAYOUT_GROUPS: dict[str, tuple[str, ...]] = {
    "full": ("FullAttentionSpec",),
    "full+sliding": ("SlidingWindowSpec", "SlidingWindowSpec", "FullAttentionSpec"),
    "sliding": ("SlidingWindowSpec",),
    "mamba-hybrid": ("MambaSpec", "FullAttentionSpec"),
}
"""The KV cache groups vLLM's planner builds for each twin layout, in order
(``tests/twin/test_engine_settings.py`` checks this against the twin's own hellos)."""


class NotReplayable(ValueError):
    """The engine's settings cannot be rebuilt on the twin (the message says why)."""


@dataclass(frozen=True)
class EngineSettings:
    """A recorded engine's settings in the terms ``kvscope whatif`` takes."""

    spec: str
    """``key:value,...`` as ``--baseline`` takes it."""
    max_model_len: int
    model: dict[str, Any]
    """TwinConfig fields beyond the spec (the model's context: at least max_model_len)."""


def layout_of(kinds: list[str]) -> str:
    """The twin layout whose groups are exactly ``kinds``, else NotReplayable."""
    for layout, groups in LAYOUT_GROUPS.items():
        if tuple(kinds) == groups:
            return layout
    raise NotReplayable(f"the engine's KV cache groups ({', '.join(kinds) or 'none'}) are "
                        "not a layout the twin builds (" + "; ".join(
                            f"{name}: {', '.join(g)}" for name, g in LAYOUT_GROUPS.items())
                        + ")")


def from_config(row: Mapping[str, Any]) -> EngineSettings:
    """Settings from one ``engine_configs`` row (or a dict of its columns)."""
    layout = layout_of(list(row["kv_group_kinds"]))
    sizes = set(row["kv_group_block_sizes"])
    if sizes != {row["block_size"]}:
        raise NotReplayable(f"the engine's KV cache groups have block sizes {sorted(sizes)}, "
                            f"the pool {row['block_size']}: the twin gives every group one")
    windows = {w for w, kind in zip(row["kv_group_windows"], row["kv_group_kinds"],
                                    strict=True) if kind == "SlidingWindowSpec"}
    if len(windows) > 1:
        raise NotReplayable(f"the engine's sliding-window groups have windows "
                            f"{sorted(windows)}: the twin gives them one")
    max_model_len = int(row["max_model_len"])
    if max_model_len <= 0:
        raise NotReplayable("the engine's probe did not report max_model_len (a probe "
                            "before it): give the settings by hand")
    on = {True: "on", False: "off"}
    pairs = [("blocks", row["num_blocks"]), ("block_size", row["block_size"]),
             ("max_seqs", row["max_num_seqs"]), ("budget", row["max_num_batched_tokens"]),
             ("policy", row["policy"]), ("prefix_caching", on[bool(row["prefix_caching"])]),
             ("layout", layout)]
    if windows:
        pairs.append(("sliding_window", windows.pop()))
    pairs += [("async_scheduling", on[bool(row["async_scheduling"])]),
              ("spec_tokens", row["spec_tokens"])]
    return EngineSettings(",".join(f"{k}:{v}" for k, v in pairs), max_model_len,
                          {"max_position_embeddings": max(max_model_len,
                                                          MAX_POSITION_EMBEDDINGS)})
