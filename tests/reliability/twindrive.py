"""vLLM's real scheduler (the twin) stepping on a thread of the test, at a steady pace and
with a steady supply of requests, the probe attached by the plugin as in a vLLM process.

Every ``schedule()`` call (vLLM's code plus the probe's hooks) is timed. The loop can be
paused at a step boundary, so a test can compare the sidecar's view with the real block
pool while nothing changes.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.workload import TwinRequest
from kvscope_probe import plugin, wire

SUPPLY = WorkloadSpec(n_requests=200, seed=7, max_tokens=(16, 160))


def endless(spec: WorkloadSpec = SUPPLY) -> Iterator[TwinRequest]:
    """The spec's requests again and again, each round with fresh request IDs."""
    base = generate(spec)
    for n in itertools.count():
        for r in base:
            yield dataclasses.replace(r, request_id=f"w{n}-{r.request_id}")


def pool_view(sched: Any) -> dict[str, int]:
    """The real BlockPool's figures, named as in the sidecar's /api/engines."""
    pool = sched.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1
    free = pool.get_num_free_blocks()
    cached = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt == 0
                 and b.block_hash is not None)
    return {"free_blocks": free, "used_blocks": usable - free, "cached_evictable_blocks": cached}


def pool_states(sched: Any) -> list[int]:
    """One ``wire.STATE_*`` per block of the real BlockPool, as the probe's mirror has it."""
    pool = sched.kv_cache_manager.block_pool
    out = []
    for b in pool.blocks:
        if b.is_null:
            out.append(wire.STATE_NULL)
        elif b.ref_cnt > 0:
            out.append(wire.STATE_USED)
        elif b.block_hash is not None and pool.enable_caching:
            out.append(wire.STATE_CACHED)
        else:
            out.append(wire.STATE_FREE)
    return out


class TwinDriver:
    """Steps a Twin every ``step_s`` seconds on its own thread, keeping about
    ``in_flight`` requests in the scheduler."""

    def __init__(self, endpoint: str | None, *, cfg: TwinConfig | None = None,
                 step_s: float = 0.002, in_flight: int = 40, seed: int = 0) -> None:
        from kvscope.twin.engine import Twin

        assert plugin.enable(endpoint)
        self.twin = Twin(cfg or TwinConfig(num_blocks=256), seed=seed)
        self.step_s = step_s
        self.in_flight = in_flight
        self.supply = endless()
        self.inbox: queue.SimpleQueue[TwinRequest] = queue.SimpleQueue()
        self.added: set[str] = set()
        """IDs of the inbox's requests the twin has taken (its arrival stamped)."""
        self.steps = 0
        self.preemptions = 0
        self.errors: list[BaseException] = []
        self.timings: list[tuple[float, int]] = []
        """(time.monotonic() at the end of the call, ns spent in schedule())."""
        self.at_pause: tuple[dict[str, int], list[int]] | None = None
        """The pool right after the last schedule() before a pause: what the probe has
        reported. (Blocks the model step frees afterwards travel with the next step, as
        in vLLM, whose engine takes one more step after requests finish.)"""
        self._pause = threading.Event()
        self._paused = threading.Event()
        self._stop = threading.Event()
        sched = self.twin.scheduler
        hooked = sched.schedule  # vLLM's schedule wrapped by the probe's hook

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            out = hooked(*args, **kwargs)
            self.timings.append((time.monotonic(), time.perf_counter_ns() - t0))
            if self._pause.is_set() and self.at_pause is None:
                self.at_pause = (pool_view(sched), pool_states(sched))
            return out

        sched.schedule = timed
        self.thread = threading.Thread(target=self._loop, name="twin-driver", daemon=True)

    @property
    def scheduler(self) -> Any:
        return self.twin.scheduler

    @property
    def recorder(self) -> Any:
        """The probe's Recorder for this scheduler (after the first step)."""
        return self.twin.scheduler.__dict__.get("_kvscope")

    def start(self) -> TwinDriver:
        self.thread.start()
        return self

    def _top_up(self) -> None:
        while True:
            try:
                req = self.inbox.get_nowait()
            except queue.Empty:
                break
            self.twin.add(req)
            self.added.add(req.request_id)
        sched = self.twin.scheduler
        while len(sched.waiting) + len(sched.running) < self.in_flight:
            self.twin.add(next(self.supply))

    def _loop(self) -> None:
        due = time.perf_counter()
        while not self._stop.is_set():
            if self._pause.is_set() and self.at_pause is not None:
                self._paused.set()
                while self._pause.is_set() and not self._stop.is_set():
                    time.sleep(0.005)
                self._paused.clear()
                due = time.perf_counter()
                continue
            try:
                self._top_up()
                out = self.twin.step()
            except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
                self.errors.append(exc)
                return
            self.steps += 1
            self.preemptions += len(out.preempted_req_ids)
            due += self.step_s
            time.sleep(max(0.0, due - time.perf_counter()))

    def pause(self, timeout_s: float = 10.0) -> tuple[dict[str, int], list[int]]:
        """Stop right after a schedule(); return ``at_pause``."""
        self._pause.set()
        if not self._paused.wait(timeout_s) or self.at_pause is None:
            raise AssertionError("the twin did not pause")
        return self.at_pause

    def resume(self) -> None:
        self.at_pause = None
        self._pause.clear()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)

    def step_ns(self, since: float, until: float) -> list[int]:
        return [ns for t, ns in list(self.timings) if since <= t < until]


def percentile(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])
