"""Can the request at the head of the waiting queue ever fit in the block pool?

vLLM admits waiting requests in queue order, so a head that needs more blocks than the
pool holds in all (``num_blocks - 1`` usable: block 0 is the null block) blocks every
request behind it for good, while the pool may look free (vLLM #39734, #35541). A head
that merely needs more blocks than are free now waits for running requests to finish.

The probe reports ``head_blocks_needed``: ``sum(cdiv(n, block_size))`` over every KV
group for the head's ``n`` tokens, an upper bound. It is the truth for full-attention
groups, which keep a block per ``block_size`` tokens of the whole sequence, but not for
sliding-window or Mamba groups, which hold far fewer, so the sum alone would call a
hybrid request unfittable when it fits. The rule here uses a lower bound instead: the
smallest ``n`` consistent with the reported sum, and only the full-attention groups'
blocks for it. "Never fits" is therefore never claimed falsely; its limit is that the
other groups' blocks are counted as zero, so a hybrid head that exceeds the pool only
through its sliding-window or Mamba share is reported as blocked, not as never fitting.
(An exact figure needs the probe to send the head's token count, or its blocks per
group from vLLM's ``get_num_blocks_to_allocate``.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvscope_probe import wire

FULL_ATTENTION_KINDS = frozenset({"FullAttentionSpec", "MLAAttentionSpec",
                                  "SinkFullAttentionSpec"})
"""KV spec classes whose group holds ``cdiv(tokens, block_size)`` blocks of a request."""

STATE_KINDS = frozenset({"MambaSpec"})
"""KV spec classes whose page is one request's recurrent state, not ``block_size`` token
slots (vLLM's ``MambaSpec``: ``tokens_per_state`` -1, one state a page whatever its
block size, which is ``max_model_len`` without prefix caching)."""



def admission_free(hello: wire.Hello, free: int, running: int) -> int:
    """The free blocks vLLM lets a waiting or preempted request take in a step that ended
    with ``running`` requests: all of them, less ``--watermark``'s reserve while any
    request runs (``KVCacheManager.allocate_slots``: ``needed + watermark_blocks > free``
    refuses it, the watermark applied when ``has_scheduled_reqs``). A step that admitted
    nobody ended with the running requests vLLM's waiting loop saw. Not counted: the
    blocks vLLM keeps back for in-flight prefills when it admits a KV connector's async
    load (``reserved_blocks``)."""
    return free - hello.watermark_blocks if running else free


def _groups(hello: wire.Hello) -> list[wire.KVGroup]:
    return list(hello.kv_groups) or [wire.KVGroup("FullAttentionSpec", hello.block_size)]


def min_tokens(groups: list[wire.KVGroup], blocks: int) -> int:
    """The fewest tokens whose blocks, summed over ``groups``, reach ``blocks``."""
    sizes = [g.block_size for g in groups]
    lo, hi = 1, blocks * min(sizes)  # cdiv(hi, min size) alone reaches blocks
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(wire.cdiv(mid, s) for s in sizes) >= blocks:
            hi = mid
        else:
            lo = mid + 1
    return lo


def full_attention_blocks(groups: Iterable[tuple[str, int]], tokens: int) -> int:
    """Blocks the full-attention groups among ``groups`` (kind, block size) hold for
    ``tokens`` tokens: one per ``block_size`` of the whole sequence."""
    return sum(wire.cdiv(tokens, bs) for kind, bs in groups if kind in FULL_ATTENTION_KINDS)


def min_blocks(hello: wire.Hello, head_blocks_needed: int) -> int:
    """A lower bound on the pool blocks the head needs: its full-attention groups' share."""
    if head_blocks_needed <= 0:
        return 0
    groups = _groups(hello)
    n = min_tokens(groups, head_blocks_needed)
    return full_attention_blocks(((g.kind, g.block_size) for g in groups), n)


@dataclass(frozen=True)
class HeadFit:
    """What the head of the waiting queue needs and whether it can ever be admitted."""

    req_id: str
    blocks_needed: int
    """The probe's upper bound (all groups, before prefix-cache hits)."""
    min_blocks: int
    """The lower bound the rule uses (full-attention groups only)."""
    usable_blocks: int
    never_fits: bool
    admission_free: int | None = None
    """Free blocks vLLM lets it take (``admission_free``); None: the pool not known."""

    def as_json(self) -> dict[str, object]:
        return {"req_id": self.req_id, "blocks_needed": self.blocks_needed,
                "min_blocks": self.min_blocks, "usable_blocks": self.usable_blocks,
                "never_fits": self.never_fits, "admission_free": self.admission_free}


def head_fit(hello: wire.Hello, step: wire.Step | None, free: int | None = None
             ) -> HeadFit | None:
    """The head's fit after ``step``; None when nothing waits. ``free``: the pool's free
    blocks, when known (``admission_free`` is then the blocks vLLM lets the head take)."""
    if step is None or step.waiting <= 0 or not step.head_req_id:
        return None
    need = min_blocks(hello, step.head_blocks_needed)
    usable = hello.num_blocks - 1
    return HeadFit(step.head_req_id, step.head_blocks_needed, need, usable, need > usable,
                   admission_free(hello, free, step.running) if free is not None else None)
