"""A model-free engine loop around vLLM's real scheduler: the twin of a vLLM server.

``Twin.step`` does what ``EngineCore.step`` does, with the model replaced by a
stand-in that samples one random token per request that finished its prefill. Block
allocation, prefix caching, admission and preemption are vLLM's own code.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvscope.twin._vllm import (
    ModelRunnerOutput,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
)
from kvscope.twin.config import TwinConfig
from kvscope.twin.scheduler import build_scheduler, request_block_hasher
from kvscope.twin.workload import TOKEN_ID_MAX, TOKEN_ID_MIN, TwinRequest

StepCallback = Callable[[int, SchedulerOutput], None]
"""Called after every step with the step's index in the run and its ``SchedulerOutput``."""


@dataclass(frozen=True)
class TwinResult:
    """What one ``Twin.run`` did."""

    steps: int
    """Scheduler steps taken (idle gaps between arrivals are skipped, not stepped)."""
    finished: int
    """Requests that finished during the run."""
    preemptions: int
    """Sum over steps of ``len(SchedulerOutput.preempted_req_ids)``."""
    scheduled_tokens: int
    """Sum over steps of ``SchedulerOutput.total_num_scheduled_tokens``."""
    wall_seconds: float


class Twin:
    """vLLM's real ``Scheduler`` and ``KVCacheManager`` driven step by step without a model."""

    def __init__(
        self,
        cfg: TwinConfig,
        scheduler_cls: type[Scheduler] | None = None,
        seed: int = 0,
    ) -> None:
        self.cfg = cfg
        self.scheduler: Scheduler = build_scheduler(cfg, scheduler_cls)
        self._block_hasher = request_block_hasher(self.scheduler)
        self._rng = random.Random(seed)
        self._last_arrival = 0.0
        self.finished = 0
        """Requests finished since the twin was built."""

    def add(self, req: TwinRequest) -> None:
        """Queue ``req`` as the OpenAI server would: ``max_tokens`` is capped to fit
        ``max_model_len`` and a prompt that leaves no room raises ``ValueError``."""
        room = self.cfg.max_model_len - len(req.prompt_token_ids)
        if room < 1:
            raise ValueError(
                f"request {req.request_id}: prompt of {len(req.prompt_token_ids)} tokens "
                f"leaves no room for output within max_model_len={self.cfg.max_model_len}"
            )
        params = SamplingParams(max_tokens=min(req.max_tokens, room), ignore_eos=True)
        # Wall-clock like the server, but strictly increasing: the priority policy breaks
        # ties on arrival_time, and a tie or a clock step back would reorder requests.
        self._last_arrival = max(time.time(), self._last_arrival + 1e-6)
        self.scheduler.add_request(
            Request(
                request_id=req.request_id,
                prompt_token_ids=list(req.prompt_token_ids),
                sampling_params=params,
                pooling_params=None,
                arrival_time=self._last_arrival,
                priority=req.priority,
                block_hasher=self._block_hasher,
            )
        )

    def has_work(self) -> bool:
        """True while a request is queued, running, or finished but not yet reported."""
        return self.scheduler.has_requests()

    def step(self) -> SchedulerOutput:
        """One engine step: schedule, fake the model's output, feed it back."""
        out = self.scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[] if requests[rid].is_prefill_chunk else [self._sample()] for rid in req_ids]
        model_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        for engine_outputs in self.scheduler.update_from_output(out, model_output).values():
            self.finished += sum(o.finish_reason is not None for o in engine_outputs.outputs)
        return out

    def _sample(self) -> int:
        return self._rng.randrange(TOKEN_ID_MIN, TOKEN_ID_MAX)

    def run(
        self,
        requests: Iterable[TwinRequest],
        on_step: StepCallback | None = None,
        max_steps: int | None = None,
        step_interval_s: float = 0.0,
    ) -> TwinResult:
        """Add each request at its ``arrival_step`` and step until all are done.

        Steps are counted from 0 at the start of the run. When the scheduler is idle
        before the next arrival, the clock jumps to it (a real engine does not step
        while idle). Stops after ``max_steps``; requests not yet added by then are dropped,
        those already added stay in the twin. ``step_interval_s`` paces the
        loop to at most one step per interval, for watching a run live.
        """
        pending = deque(sorted(requests, key=lambda r: r.arrival_step))
        finished_before = self.finished
        steps = clock = preemptions = scheduled_tokens = 0
        started = next_due = time.perf_counter()
        while (pending or self.has_work()) and (max_steps is None or steps < max_steps):
            if pending and not self.has_work():
                clock = max(clock, pending[0].arrival_step)
            while pending and pending[0].arrival_step <= clock:
                self.add(pending.popleft())
            out = self.step()
            preemptions += len(out.preempted_req_ids)
            scheduled_tokens += out.total_num_scheduled_tokens
            if on_step is not None:
                on_step(steps, out)
            steps += 1
            clock += 1
            if step_interval_s > 0:
                next_due += step_interval_s
                time.sleep(max(0.0, next_due - time.perf_counter()))
        return TwinResult(
            steps=steps,
            finished=self.finished - finished_before,
            preemptions=preemptions,
            scheduled_tokens=scheduled_tokens,
            wall_seconds=time.perf_counter() - started,
        )
