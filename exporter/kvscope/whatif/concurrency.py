"""Safe concurrency: how many requests of this traffic run at once before preemptions start.

A closed loop on the twin, as ``kvscope loadgen --concurrency C`` drives a server: the
first C requests (in the traffic's order) arrive together; each time one ends, the next
arrives. Under vLLM's real scheduler a run of the whole traffic either preempts or not.

Timing changes which requests overlap: on a server the next request reaches the engine
a few steps after the previous one ended (the HTTP round trip, tokenizing), and those
delays shift every later overlap; and the API server tokenizes requests concurrently, so
neighbours can reach the scheduler the other way round (a server's recorded queue order
differs from the order its client sent in). So each concurrency is run ``trials`` times:
once with no delay, then with each next arrival delayed by a seeded random
0..``max_delay`` steps, in every other trial also with neighbouring requests swapped
(``SWAP_PROBABILITY``).
The answer, ``safe``, is the largest C at which no trial of C or of any smaller
concurrency preempts; ``preempts_from`` is the smallest C at which every trial preempts.
Between them the answer depends on timing. The scan goes on to ``first_wave_from``, the
smallest C at which every trial preempts before any request has ended: there the first
C requests alone overflow the pool, so no timing of later arrivals can avoid it. Above
``max_num_seqs`` requests wait rather than run, so the scan stops there.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvscope.twin.config import TwinConfig
from kvscope.twin.workload import TwinRequest

TRIALS = 12
MAX_DELAY_STEPS = 4
SWAP_PROBABILITY = 0.25
"""In the even-seeded trials, each request swaps places with the next at this rate."""


@dataclass(frozen=True)
class Trial:
    concurrency: int
    delay_seed: int | None
    """None: every next arrival in the step after an end, in the traffic's order; else the
    delays' seed (an even seed also swaps neighbours)."""
    preemptions: int
    """Preemptions in the step of the first (the run stops there); 0: none at all."""
    first_wave: bool
    """The first preemption came before any request ended: the delays between an end
    and the next arrival played no part in it."""
    peak_running: int
    peak_used_blocks: int


@dataclass(frozen=True)
class Answer:
    safe: int
    """Largest concurrency with no preemption in any trial (nor below it); 0: even one
    request alone is preempted."""
    preempts_from: int | None
    """Smallest concurrency at which every trial preempts; None: none up to the cap."""
    first_wave_from: int | None
    """Smallest concurrency at which every trial preempts before any request ended;
    None: none up to the cap."""
    cap: int
    """The highest concurrency scanned: max_num_seqs (or the traffic's size)."""
    trials: list[Trial] = field(default_factory=list)

    @property
    def capped(self) -> bool:
        """No preemption up to ``cap``: max_num_seqs binds before the pool does."""
        return self.preempts_from is None and self.safe == self.cap

    def at(self, concurrency: int) -> list[Trial]:
        """The trials run at ``concurrency``."""
        return [t for t in self.trials if t.concurrency == concurrency]


def closed_loop(cfg: TwinConfig, requests: Sequence[TwinRequest], concurrency: int, *,
                seed: int = 0, delay_seed: int | None = None,
                max_delay: int = MAX_DELAY_STEPS, max_steps: int = 1_000_000) -> Trial:
    """Run ``requests`` at most ``concurrency`` in flight; stop at the first preemption."""
    from kvscope.twin.engine import Twin

    twin = Twin(cfg, seed=seed)
    rng = random.Random(delay_seed)
    order = list(requests)
    if delay_seed is not None and delay_seed % 2 == 0:  # neighbours the other way round
        for i in range(len(order) - 1):
            if rng.random() < SWAP_PROBABILITY:
                order[i], order[i + 1] = order[i + 1], order[i]
    todo = deque(order)
    def delay() -> int:
        return 0 if delay_seed is None else rng.randint(0, max_delay)

    due = [delay() for _ in range(min(concurrency, len(todo)))]  # next arrivals' steps
    steps = ended_before = preemptions = peak_running = peak_used = 0
    pool = twin.scheduler.kv_cache_manager.block_pool
    while (todo or twin.has_work()) and steps < max_steps:
        due.sort()
        if due and not twin.has_work():
            steps = max(steps, due[0])
        while todo and due and due[0] <= steps:
            due.pop(0)
            twin.add(todo.popleft())
        out = twin.step()
        steps += 1
        if out is None:
            continue
        running = len(twin.scheduler.running)
        peak_running = max(peak_running, running)
        peak_used = max(peak_used, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        if out.preempted_req_ids:
            preemptions = len(out.preempted_req_ids)
            break
        due += [steps + delay() for _ in range(twin.finished - ended_before)]
        ended_before = twin.finished
    return Trial(concurrency, delay_seed, preemptions, preemptions > 0 and ended_before == 0,
                 peak_running, peak_used)


def safe_concurrency(cfg: TwinConfig, requests: Sequence[TwinRequest], *, seed: int = 0,
                     trials: int = TRIALS, max_delay: int = MAX_DELAY_STEPS) -> Answer:
    """Scan concurrency 1, 2, ... up to max_num_seqs (see the module docstring)."""
    cap = min(cfg.max_num_seqs, len(requests))
    seeds: list[int | None] = [None, *range(1, trials)]
    done: list[Trial] = []
    safe, preempts_from = 0, None
    for c in range(1, cap + 1):
        runs = [closed_loop(cfg, requests, c, seed=seed, delay_seed=s, max_delay=max_delay)
                for s in seeds]
        done += runs
        hit = [t.preemptions > 0 for t in runs]
        if not any(hit) and safe == c - 1:
            safe = c
        if all(hit) and preempts_from is None:
            preempts_from = c
        if all(t.first_wave for t in runs):
            return Answer(safe, preempts_from, c, cap, done)
    return Answer(safe, preempts_from, None, cap, done)
