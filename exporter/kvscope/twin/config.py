"""The twin's configuration: the scheduler and KV-pool knobs of a vLLM server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvscope.models.config import MAX_POSITION_EMBEDDINGS

Policy = Literal["fcfs", "priority"]
POLICIES: tuple[Policy, ...] = ("fcfs", "priority")

Layout = Literal["full", "full+sliding", "sliding", "mamba-hybrid"]
LAYOUTS: tuple[Layout, ...] = ("full", "full+sliding", "sliding", "mamba-hybrid")
"""KV layouts of the models vLLM serves (see ``kvscope.twin.kv_layout`` for their layers):
full attention only (Llama); sliding-window and full-attention layers interleaved
(Gemma 2/3, gpt-oss); sliding window only (Mistral 7B v0.1); Mamba and full-attention
layers (Jamba, Nemotron-H, granite-4.0-h)."""

GROUP_KINDS = ("full", "sliding", "mamba")
"""What one KV cache group of ``TwinConfig.groups`` can be."""
GROUP_OF_SPEC = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding",
                 "MambaSpec": "mamba"}
"""The KV cache spec classes the twin has a stand-in layer for, as its group kinds."""
LAYOUT_KINDS: dict[Layout, frozenset[str]] = {
    "full": frozenset({"full"}), "full+sliding": frozenset({"full", "sliding"}),
    "sliding": frozenset({"sliding"}), "mamba-hybrid": frozenset({"mamba", "full"}),
}

BLOCK_SIZE_MULTIPLE = 16
"""vLLM's attention backends take block sizes that are multiples of 16 (CUDA, ROCm) or
32 (the CPU backend). The twin runs no attention, so it accepts the looser rule."""


@dataclass(frozen=True)
class TwinConfig:
    """Scheduler and KV-cache settings, named after the vLLM flags they mirror."""

    block_size: int = 32
    """Tokens per KV block (``--block-size``)."""

    num_blocks: int = 48
    """Blocks in the pool, the null block included (``--num-gpu-blocks-override``)."""

    max_num_seqs: int = 32
    """Most requests running at once (``--max-num-seqs``)."""

    max_num_batched_tokens: int = 512
    """Tokens the model runner takes in one step (``--max-num-batched-tokens``); the
    scheduler's budget too unless ``max_num_scheduled_tokens`` is set."""

    max_num_scheduled_tokens: int | None = None
    """Token budget the scheduler fills each step (``--max-num-scheduled-tokens``,
    vLLM's ``Scheduler.max_num_scheduled_tokens``, a probe hello's ``token_budget``).
    None: vLLM's default, ``max_num_batched_tokens``."""

    max_model_len: int = 1024
    """Longest prompt plus output (``--max-model-len``)."""

    policy: Policy = "fcfs"
    """Queue order and preemption victim choice (``--scheduling-policy``)."""

    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (``--enable-prefix-caching``)."""

    layout: Layout = "full"
    """The model's KV layout: which KV cache groups vLLM builds over the one pool."""

    sliding_window: int = 128
    """Tokens a sliding-window layer attends to (the model config's ``sliding_window``);
    used by the ``full+sliding`` and ``sliding`` layouts."""

    async_scheduling: bool = False
    """vLLM's ``AsyncScheduler`` with one step in flight (``--async-scheduling``, the
    default on GPUs); False: the synchronous ``Scheduler`` (the CPU build's only one)."""

    num_speculative_tokens: int = 0
    """Draft tokens per step of a draft-model speculator (``--speculative-config
    '{"method": "draft_model", "num_speculative_tokens": N}'``); N > 0 also reserves N
    lookahead slots in every allocation. 0: no speculative decoding."""

    groups: tuple[str, ...] = ()
    """The KV cache groups of a served model, one kind each (``full``, ``sliding``,
    ``mamba``) in vLLM's order, when they are not the layout's stand-in model's (a Gemma 3 12B
    of five sliding-window groups and one full one): the twin builds one layer per group,
    which vLLM's planner groups back into exactly these. Empty: the layout's stand-in.
    Read from an engine's hello by ``kvscope.whatif.engine_settings``."""

    decode_context_parallel_size: int = 1
    """Ranks decode attention's KV is sharded across (``--decode-context-parallel-size``):
    vLLM's managers then allocate blocks of ``block_size x`` this many tokens. The twin
    runs no model: the tensor-parallel size it implies (twice this, above the tiny model's
    two KV heads, as vLLM's config check requires) only passes that check."""

    watermark: float = 0.0
    """Fraction of the pool vLLM keeps free from waiting and preempted requests while any
    request runs (``--watermark``; 0, vLLM's default: none)."""

    max_position_embeddings: int = MAX_POSITION_EMBEDDINGS
    """The served model's context (its config.json), which bounds ``max_model_len``: the
    tiny model's by default, a user's model's with ``kvscope whatif --model``."""

    def layout_summary(self) -> str:
        """The KV layout and scheduler in one line: ``full+sliding (window 128 tokens),
        AsyncScheduler, 2 draft tokens/step``."""
        parts = [self.layout]
        if self.layout in ("full+sliding", "sliding"):
            parts[0] += f" (window {self.sliding_window} tokens)"
        if self.groups:
            parts[0] += f", groups {'+'.join(self.groups)}"
        parts.append("AsyncScheduler" if self.async_scheduling else "Scheduler")
        if self.num_speculative_tokens:
            parts.append(f"{self.num_speculative_tokens} draft tokens/step")
        return ", ".join(parts)

    def validate(self) -> list[str]:
        """Every problem with this config, one sentence each; empty when it is usable."""
        errors: list[str] = []
        if self.block_size <= 0 or self.block_size % BLOCK_SIZE_MULTIPLE:
            errors.append(
                f"block_size must be a positive multiple of {BLOCK_SIZE_MULTIPLE}, "
                f"got {self.block_size}."
            )
        if self.num_blocks < 2:
            errors.append(
                f"num_blocks must be at least 2 (block 0 is the null block), got {self.num_blocks}."
            )
        if self.max_num_seqs < 1:
            errors.append(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < max(1, self.max_num_seqs):
            errors.append(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}), as vLLM requires."
            )
        if self.max_num_scheduled_tokens is not None and self.max_num_scheduled_tokens < 1:
            errors.append(  # SchedulerConfig's own bound (ge=1)
                f"max_num_scheduled_tokens must be at least 1, got "
                f"{self.max_num_scheduled_tokens}."
            )
        if not 1 <= self.max_model_len <= self.max_position_embeddings:
            whose = ("the tiny model's positions; --model names a served model's"
                     if self.max_position_embeddings == MAX_POSITION_EMBEDDINGS
                     else "the model's max_position_embeddings")
            errors.append(
                f"max_model_len must be between 1 and {self.max_position_embeddings} "
                f"({whose}), got {self.max_model_len}."
            )
        if self.layout not in LAYOUTS:
            errors.append(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}.")
        elif self.groups and set(self.groups) != LAYOUT_KINDS[self.layout]:
            errors.append(f"groups must be {' and '.join(sorted(LAYOUT_KINDS[self.layout]))} "
                          f"groups for layout {self.layout}, got {'+'.join(self.groups)}.")
        if self.sliding_window < 1:
            errors.append(f"sliding_window must be at least 1, got {self.sliding_window}.")
        if self.num_speculative_tokens < 0:
            errors.append(
                f"num_speculative_tokens must not be negative, got {self.num_speculative_tokens}."
            )
        if self.block_size > 0 and self.num_blocks >= 2 and self.layout != "sliding":
            capacity = ((self.num_blocks - 1) * self.block_size
                        * max(1, self.decode_context_parallel_size))
            if capacity < self.max_model_len:
                # vLLM refuses to start when one full-length request cannot fit; the
                # scheduler would otherwise preempt that request forever. A layout with a
                # full-attention group needs at least this; vLLM's own check (run when
                # the scheduler is built) also counts the other groups.
                errors.append(
                    f"the pool holds {capacity} tokens ((num_blocks - 1) * block_size * "
                    f"decode_context_parallel_size), "
                    f"fewer than max_model_len ({self.max_model_len})."
                )
        if self.policy not in POLICIES:
            errors.append(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}.")
        return errors
