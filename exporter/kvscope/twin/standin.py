"""The model executor's stand-in: what a worker returns for a step, with no model.

``execute(out)`` plays ``execute_model`` + ``sample_tokens`` for one ``SchedulerOutput``,
read right after ``schedule()`` returned, as a worker reads it: a request whose prefill
is still partial samples nothing; any other samples one token plus the draft tokens the
rejection sampler accepts (each with ``DRAFT_ACCEPTANCE``, given the earlier ones were
accepted). ``take_draft_token_ids()`` is what a draft-model speculator proposes for the
next step (``num_speculative_tokens`` per request of the last batch). Tokens are random
word ids, seeded.
"""

from __future__ import annotations

import random

from kvscope.twin._vllm import DraftTokenIds, ModelRunnerOutput, Scheduler, SchedulerOutput
from kvscope.twin.workload import TOKEN_ID_MAX, TOKEN_ID_MIN

DRAFT_ACCEPTANCE = 0.7
"""Chance that the target model accepts a draft token after accepting the earlier ones."""


class StandInModel:
    """Sampled and draft token ids for the steps of one scheduler."""

    def __init__(self, scheduler: Scheduler, seed: int = 0) -> None:
        self.scheduler = scheduler
        self.num_draft_tokens = int(scheduler.num_spec_tokens)
        self._rng = random.Random(seed)
        self._last_batch: list[str] = []

    def _tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(TOKEN_ID_MIN, TOKEN_ID_MAX) for _ in range(n)]

    def _accepted(self, drafts: int) -> int:
        n = 0
        while n < drafts and self._rng.random() < DRAFT_ACCEPTANCE:
            n += 1
        return n

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The model runner's output for ``out``; call before the scheduler moves on."""
        requests = self.scheduler.requests
        drafts = out.scheduled_spec_decode_tokens
        req_ids = list(out.num_scheduled_tokens)
        sampled = [
            [] if requests[rid].is_prefill_chunk
            else self._tokens(1 + self._accepted(len(drafts.get(rid, ()))))
            for rid in req_ids
        ]
        self._last_batch = req_ids
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """Draft tokens for every request of the last batch; None without a speculator."""
        if not self.num_draft_tokens or not self._last_batch:
            return None
        ids = self._last_batch
        return DraftTokenIds(ids, [self._tokens(self.num_draft_tokens) for _ in ids])
