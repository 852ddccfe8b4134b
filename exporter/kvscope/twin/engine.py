"""A model-free engine loop around vLLM's real scheduler: the twin of a vLLM server.

``Twin.step`` does what ``EngineCore`` does per step, with the model replaced by a
stand-in (``kvscope.twin.standin``): ``EngineCore.step`` for the synchronous scheduler,
``EngineCore.step_with_batch_queue`` for the async one (``v1/engine/core.py``: a step
is scheduled while the previous one is in flight; its output is fed back one step
later). Block allocation, prefix caching, admission and preemption are vLLM's own code.
"""

from __future__ import annotations

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
from kvscope.twin.standin import StandInModel
from kvscope.twin.workload import TwinRequest

StepCallback = Callable[[int, SchedulerOutput], None]
"""Called after every step with the step's index in the run and its ``SchedulerOutput``."""


@dataclass(frozen=True)
class TwinResult:
    """What one ``Twin.run`` did."""

    steps: int
    """``schedule()`` calls (idle gaps between arrivals are skipped, not stepped; the
    async engine's last steps that only collect in-flight outputs are not counted)."""
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
        self.model = StandInModel(self.scheduler, seed)
        # EngineCore keeps a batch queue when more than one batch may be in flight
        # (v1/engine/core.py __init__: batch_queue_size = max_concurrent_batches).
        size = self.scheduler.vllm_config.max_concurrent_batches
        self._batch_queue_size = size
        self._batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] | None = (
            deque() if size > 1 else None
        )
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
        """True while a request is queued, running, in flight, or finished but not yet
        reported."""
        return self.scheduler.has_requests() or bool(self._batch_queue)

    def step(self) -> SchedulerOutput | None:
        """One engine step; returns the output it scheduled (None: it only collected the
        output of a step in flight)."""
        if self._batch_queue is None:
            out = self.scheduler.schedule()
            self._update(out, self.model.execute(out))
            # EngineCore.post_step: a synchronous engine hands the drafts over itself.
            drafts = self.model.take_draft_token_ids()
            if drafts is not None and out.total_num_scheduled_tokens > 0:
                self.scheduler.update_draft_token_ids(drafts)
            return out
        return self._step_with_batch_queue(self._batch_queue)

    def _step_with_batch_queue(
        self, queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]]
    ) -> SchedulerOutput | None:
        """``EngineCore.step_with_batch_queue``: schedule while the queue has room, feed
        back the oldest step's output once it is full (or nothing is left to schedule)."""
        out = None
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            queue.appendleft((out, self.model.execute(out)))
            executed = out.total_num_scheduled_tokens > 0
            if len(queue) < self._batch_queue_size and (
                executed or self.scheduler.has_requests()
            ):
                return out
        elif not queue:
            return None
        self._update(*queue.pop())
        return out

    def _update(self, out: SchedulerOutput, model_output: ModelRunnerOutput) -> None:
        for engine_outputs in self.scheduler.update_from_output(out, model_output).values():
            self.finished += sum(o.finish_reason is not None for o in engine_outputs.outputs)

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
            if out is None:
                continue
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
