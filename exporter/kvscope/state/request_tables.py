"""What the request tracker knows of one live request, and its block-table accounting.

Blocks held, contiguity (fragments: runs of consecutive block IDs) and the peak are kept
from the tables the steps report, whole or as growth, never by re-reading a table.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Live:
    """What is known of one request between its arrival and its end."""

    arrival_ts: float
    prompt_len: int = 0
    max_tokens: int = 0
    admitted_ts: float = -1.0
    first_token_ts: float = -1.0
    free_at_alloc: int = -1
    maxrun_at_alloc: int = -1
    cached_tokens: int = -1
    blocks: int = 0
    peak_blocks: int = 0
    fragments: int = 0
    last_ids: list[int] = field(default_factory=list)
    preemptions: int = 0
    last_reason: str = ""
    lost_tokens: int = 0
    """Computed tokens its last preemption discarded, until it resumes (-1 unknown: it was
    preempted before this sidecar took the engine up)."""
    recomputed: int = 0
    arrival_seen: bool = True
    """False when the tracker first heard of the request after its arrival (a sidecar that
    took the engine up mid-run): at its admission, or running at a keyframe, or at a resume
    (``RequestTracker._take_up``). ``arrival_ts`` is then that step's time, and nothing is
    measured from it."""


def set_table(live: Live, groups: list[list[int]]) -> None:
    """Blocks held (null placeholders excluded) and their runs, from a whole table."""
    live.blocks = 0
    live.fragments = 0
    live.last_ids = []
    for ids in groups:
        prev = -2
        for b in ids:
            if b == 0:  # vLLM's null block: a placeholder, not a held block
                continue
            live.blocks += 1
            live.fragments += b != prev + 1
            prev = b
        live.last_ids.append(prev)
    live.peak_blocks = max(live.peak_blocks, live.blocks)


def extend_table(live: Live, groups: list[list[int]]) -> int:
    """Blocks added by a table's growth (its runs continue from the last block). The
    request tracker takes the most common growth, one block in a one-group table, itself
    (``RequestTracker._step``)."""
    last = live.last_ids
    while len(last) < len(groups):
        last.append(-2)
    added = 0
    breaks = 0
    for g, ids in enumerate(groups):  # usually one group and one block: kept to locals
        if ids:
            prev = last[g]
            for b in ids:
                if b != prev + 1:
                    breaks += 1
                prev = b
            last[g] = prev
            added += len(ids)
    live.fragments += breaks
    blocks = live.blocks = live.blocks + added
    if blocks > live.peak_blocks:
        live.peak_blocks = blocks
    return added
