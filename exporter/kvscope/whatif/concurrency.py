"""Safe concurrency: how many requests of this traffic run at once before preemptions start.

A closed loop on the twin, as ``kvscope loadgen --concurrency C`` drives a server: the
first C requests (in the traffic's order) arrive together; each time one ends, the next
arrives. Under vLLM's real scheduler a run of the whole traffic either preempts or not.

Timing changes which requests overlap: on a server the next request reaches the engine
some steps after the previous one ended (the HTTP round trip, tokenizing; the engine
goes on stepping meanwhile), and those delays shift every later overlap; and the API
server tokenizes requests concurrently, so neighbours can reach the scheduler the other
way round (a server's recorded queue order differs from the order its client sent in).
So each concurrency is run ``trials`` times: once with no delay, then with every arrival
(the first C too) delayed by a seeded 0 to ``MAX_DELAY_STEPS`` steps and, given a
recorded ``client`` (``kvscope.whatif.client``), held further while that client held
its requests, its pattern replayed from a seeded offset; in every other trial also with
neighbouring requests swapped (``SWAP_PROBABILITY``).
The trials' answer, ``trials_safe``, is the largest C at which no trial of C or of any
smaller concurrency preempts; ``preempts_from`` is the smallest C at which every trial
preempts. Between them the outcome depends on timing.

No set of trials covers every client: one starved of CPU holds the requests released
while all C in flight end, then sends C together, from anywhere in the traffic. So the
answer, ``safe``, is the one no timing can break: the largest C whose C largest requests
fit the pool together, each at its peak (``peak_blocks``: the most blocks the request
holds run alone on vLLM's scheduler, for the layout's every KV group). A running
request is preempted only when it needs a block and none is free or evictable; with C
requests in flight that cannot happen while any C of them fit at once. It is never above
``trials_safe``. The scan goes on to ``first_wave_from``, the
smallest C at which every trial preempts before any request has ended: there the first
C requests alone overflow the pool, so no timing of later arrivals can avoid it. Above
``max_num_seqs`` requests wait rather than run, so the scan stops there.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvscope.twin.config import TwinConfig
from kvscope.twin.workload import TwinRequest
from kvscope.whatif.client import Client

TRIALS = 12
MAX_DELAY_STEPS = 4
SWAP_PROBABILITY = 0.25
"""In the even-seeded trials, each request swaps places with the next at this rate."""
LATENCY = tuple(range(MAX_DELAY_STEPS + 1))
"""Steps a request sent at once takes to reach the scheduler (HTTP, tokenizing): drawn
uniformly, for the first wave and for every next request."""


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
    arrivals: tuple[int, ...] = field(default=(), repr=False)
    """The step each request arrived in, in the order they arrived (up to the stop)."""


@dataclass(frozen=True)
class Answer:
    safe: int
    """Largest concurrency at which no timing can preempt: the ``safe`` largest peaks
    fit the pool's usable blocks together (capped at ``cap``)."""
    trials_safe: int
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
    peaks: tuple[int, ...] = ()
    """Each request's peak blocks run alone, largest first."""

    @property
    def capped(self) -> bool:
        """No preemption up to ``cap``: max_num_seqs binds before the pool does."""
        return self.preempts_from is None and self.trials_safe == self.cap

    def at(self, concurrency: int) -> list[Trial]:
        """The trials run at ``concurrency``."""
        return [t for t in self.trials if t.concurrency == concurrency]


def closed_loop(cfg: TwinConfig, requests: Sequence[TwinRequest], concurrency: int, *,
                seed: int = 0, delay_seed: int | None = None,
                client: Client | None = None, latency: Sequence[int] = LATENCY,
                max_steps: int = 1_000_000) -> Trial:
    """Run ``requests`` at most ``concurrency`` in flight; stop at the first preemption.
    With a ``delay_seed``, each arrival comes a draw from ``latency`` steps late, and
    later while the recorded ``client`` held its requests."""
    from kvscope.twin.engine import Twin

    twin = Twin(cfg, seed=seed)
    rng = random.Random(delay_seed)
    order = list(requests)
    if delay_seed is not None and delay_seed % 2 == 0:  # neighbours the other way round
        for i in range(len(order) - 1):
            if rng.random() < SWAP_PROBABILITY:
                order[i], order[i + 1] = order[i + 1], order[i]
    todo = deque(order)
    offset = rng.randrange(client.span) if client is not None else 0

    def delay() -> int:
        return 0 if delay_seed is None else rng.choice(latency)

    def send(released: int) -> int:
        at = released + delay()
        return at if client is None or delay_seed is None else client.send_step(at, offset)

    due = [delay() for _ in range(min(concurrency, len(todo)))]  # the first wave
    steps = ended_before = preemptions = peak_running = 0
    arrivals: list[int] = []
    peak = _peak_watch(twin)
    while (todo or twin.has_work()) and steps < max_steps:
        due.sort()
        if due and not twin.has_work():
            steps = max(steps, due[0])
        while todo and due and due[0] <= steps:
            due.pop(0)
            twin.add(todo.popleft())
            arrivals.append(steps)
        out = twin.step()
        steps += 1
        if out is None:
            continue
        running = len(twin.scheduler.running)
        peak_running = max(peak_running, running)
        if out.preempted_req_ids:
            preemptions = len(out.preempted_req_ids)
            break
        due += [send(steps) for _ in range(twin.finished - ended_before)]
        ended_before = twin.finished
    return Trial(concurrency, delay_seed, preemptions, preemptions > 0 and ended_before == 0,
                 peak_running, peak[0], tuple(arrivals))


def _peak_watch(twin: Any) -> list[int]:
    """A one-item list that holds the most blocks in use right after any ``schedule()``
    of ``twin``: a request's last block can be taken and freed within one step (its last
    token needs it; it ends in the same step), so after the step it is too late to look."""
    pool = twin.scheduler.kv_cache_manager.block_pool
    inner = twin.scheduler.schedule
    peak = [0]

    def schedule() -> Any:
        out = inner()
        peak[0] = max(peak[0], pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        return out

    twin.scheduler.schedule = schedule  # this twin's scheduler alone (an instance attribute)
    return peak


def peak_blocks(cfg: TwinConfig, requests: Sequence[TwinRequest]) -> list[int]:
    """The most blocks each request holds run alone (one run per distinct length pair)."""
    seen: dict[tuple[int, int], int] = {}
    for r in requests:
        key = (len(r.prompt_token_ids), r.max_tokens)
        if key not in seen:
            seen[key] = closed_loop(cfg, [r], 1).peak_used_blocks
    return [seen[(len(r.prompt_token_ids), r.max_tokens)] for r in requests]


def fits_any_timing(peaks: Sequence[int], usable: int, cap: int) -> int:
    """The largest C (at most ``cap``) whose C largest ``peaks`` sum to <= ``usable``."""
    total = count = 0
    for p in sorted(peaks, reverse=True)[:cap]:
        if total + p > usable:
            break
        total, count = total + p, count + 1
    return count


def safe_concurrency(cfg: TwinConfig, requests: Sequence[TwinRequest], *, seed: int = 0,
                     trials: int = TRIALS, client: Client | None = None) -> Answer:
    """Scan concurrency 1, 2, ... up to max_num_seqs (see the module docstring)."""
    cap = min(cfg.max_num_seqs, len(requests))
    peaks = tuple(sorted(peak_blocks(cfg, requests), reverse=True))
    fits = fits_any_timing(peaks, cfg.num_blocks - 1, cap)
    seeds: list[int | None] = [None, *range(1, trials)]
    done: list[Trial] = []
    safe, preempts_from = 0, None
    for c in range(1, cap + 1):
        runs = [closed_loop(cfg, requests, c, seed=seed, delay_seed=s, client=client)
                for s in seeds]
        done += runs
        hit = [t.preemptions > 0 for t in runs]
        if not any(hit) and safe == c - 1:
            safe = c
        if all(hit) and preempts_from is None:
            preempts_from = c
        if all(t.first_wave for t in runs):
            return Answer(min(fits, safe), safe, preempts_from, c, cap, done, peaks)
    return Answer(min(fits, safe), safe, preempts_from, None, cap, done, peaks)
