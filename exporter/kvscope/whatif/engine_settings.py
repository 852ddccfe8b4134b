"""A recorded engine's settings for the twin, from its hello as the store keeps it
(table ``engine_configs``): what ``kvscope explain --counterfactual engine`` replays the
window under, with nothing typed by hand.

The pool (blocks, block size), the scheduler's limits (max_num_seqs,
max_num_batched_tokens and the token budget each step is scheduled with, vLLM's
max_num_scheduled_tokens where it is smaller; max_model_len, policy, prefix caching),
its kind (``AsyncScheduler`` or not), the speculative tokens and the blocks
``--watermark`` holds back come across as they are, and so do the KV cache groups, group
for group: the twin builds one stand-in layer per group (``TwinConfig.groups``) where
the engine's groups are not a layout's own stand-in's, and vLLM's planner groups those
layers back into exactly the engine's groups (it makes the least numerous kind of layer
one group, so a layer per group is a group per layer: a Gemma 3 12B's five
sliding-window groups and one full group stay six tables a request). What the twin
cannot build is refused with the reason, never matched to the nearest: a kind of group
it has no stand-in for (MLA, chunked local attention, ...), groups of several block
sizes or sliding windows, or a grouping vLLM's planner does not make.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvscope.models.config import MAX_POSITION_EMBEDDINGS
from kvscope.twin.config import GROUP_OF_SPEC, LAYOUT_KINDS, TwinConfig
from kvscope.whatif.settings import KEYS, build, format_groups

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

    def config(self) -> TwinConfig:
        """The TwinConfig these settings build; NotReplayable with every reason where the
        twin refuses them (a pool vLLM would not start with, say)."""
        errors: list[str] = []
        found = build({k: [] for k in KEYS}, [f"server={self.spec}"],
                      max_model_len=self.max_model_len, bytes_per_token=1, errors=errors,
                      model=self.model)
        if errors:
            raise NotReplayable("; ".join(errors))
        return found[0].config


def layout_of(kinds: list[str]) -> tuple[str, tuple[str, ...]]:
    """(twin layout, ``TwinConfig.groups``) for KV cache groups of spec classes ``kinds``:
    groups ``()`` where they are the layout's stand-in's. NotReplayable otherwise."""
    unknown = sorted({k for k in kinds if k not in GROUP_OF_SPEC})
    if unknown or not kinds:
        raise NotReplayable(f"the engine's KV cache groups ({', '.join(kinds) or 'none'}) "
                            f"include {', '.join(unknown) or 'none'}: the twin builds "
                            f"{', '.join(GROUP_OF_SPEC)} groups only")
    for layout, groups in LAYOUT_GROUPS.items():
        if tuple(kinds) == groups:
            return layout, ()
    short = tuple(GROUP_OF_SPEC[k] for k in kinds)
    counts = Counter(short)
    layout = next((name for name, ks in LAYOUT_KINDS.items() if set(counts) == ks), None)
    if layout is None or len(counts) == 1 or min(counts.values()) != 1:
        raise NotReplayable(f"the engine's KV cache groups ({', '.join(kinds)}) are not a "
                            "grouping vLLM's planner makes of a model the twin can stand in "
                            "for (one kind of layer is one group; mamba goes with full)")
    return layout, short


def watermark_fraction(held: int, num_blocks: int) -> float:
    """The least ``--watermark`` with which vLLM holds back ``held`` of ``num_blocks``
    blocks (``KVCacheManager``: ``int(watermark * num_blocks)``): the engine's own
    fraction is not in its hello, only the blocks it comes to."""
    w = held / num_blocks
    while int(w * num_blocks) < held:  # the division rounded down
        w = math.nextafter(w, 1.0)
    return w


def from_config(row: Mapping[str, Any]) -> EngineSettings:
    """Settings from one ``engine_configs`` row (or a dict of its columns)."""
    layout, groups = layout_of(list(row["kv_group_kinds"]))
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
    if groups:
        pairs.append(("groups", format_groups(groups)))
    budget = int(row.get("token_budget") or row["max_num_batched_tokens"])
    if budget != int(row["max_num_batched_tokens"]):
        # vLLM budgets a step by max_num_scheduled_tokens (the hello's token_budget)
        pairs.insert(4, ("scheduled_tokens", budget))
    if windows:
        pairs.append(("sliding_window", windows.pop()))
    pairs += [("async_scheduling", on[bool(row["async_scheduling"])]),
              ("spec_tokens", row["spec_tokens"])]
    held = int(row.get("watermark_blocks", 0))
    if held > 0:
        pairs.append(("watermark", repr(watermark_fraction(held, int(row["num_blocks"])))))
    return EngineSettings(",".join(f"{k}:{v}" for k, v in pairs), max_model_len,
                          {"max_position_embeddings": max(max_model_len,
                                                          MAX_POSITION_EMBEDDINGS)})
