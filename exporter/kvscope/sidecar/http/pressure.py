"""``/health/preempt-rate``: one small JSON an autoscaler or a client can poll.

preemption_rate = preemptions / requests ended, over the last ``window_s`` seconds of
sidecar time, all engines together (1.0 when preemptions came and no request ended: JSON
has no infinity, and it is above every threshold). The pool's figures are of the engines
connected now (``connected``: active or idle), as an engine that crashed or went silent
keeps its last pool until the hub forgets it (an hour): free_block_ratio is the lowest
current free / usable blocks over those with an exact ledger, waiting their waiting
requests summed, engines how many they are. The recommendation is a plain threshold rule:
``shed`` above ``shed_rate`` (or an engine with no free block and requests waiting),
``backoff`` above ``backoff_rate`` (or under ``backoff_free_ratio`` free), else ``ok``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscope.state.engine import EngineState


@dataclass(frozen=True)
class PressurePolicy:
    backoff_rate: float = 0.05
    shed_rate: float = 0.10
    backoff_free_ratio: float = 0.05


def _delta(st: EngineState, now: float, window_s: float) -> tuple[int, int]:
    pre_now = sum(st.counters.preemptions.values())
    ends_now = sum(st.counters.ends.values())
    base = None
    for t, pre, ends in reversed(st.history):
        if now - t >= window_s:
            base = (pre, ends)
            break
    if base is None:  # younger than the window: everything since it connected
        base = (0, 0)
    return pre_now - base[0], ends_now - base[1]


def preempt_rate(engines: list[EngineState], window_s: float,
                 policy: PressurePolicy | None = None, now: float | None = None,
                 connected: Callable[[EngineState], bool] | None = None) -> dict[str, Any]:
    """``engines``: every engine the hub knows (their preemptions and ends in the window
    count, connected or not); ``connected``: whether one is there now (all by default)."""
    policy = policy or PressurePolicy()
    now = time.monotonic() if now is None else now
    preemptions = requests = 0
    free_ratio: float | None = None
    waiting = live = 0
    full_and_waiting = False
    for st in engines:
        p, r = _delta(st, now, window_s)
        preemptions += p
        requests += r
        if connected is not None and not connected(st):
            continue
        live += 1
        queued = st.last_step.waiting if st.last_step is not None else 0
        waiting += queued
        if st.ledger.synced and st.ledger.usable_blocks:
            ratio = st.ledger.free / st.ledger.usable_blocks
            free_ratio = ratio if free_ratio is None else min(free_ratio, ratio)
            full_and_waiting = full_and_waiting or (ratio == 0.0 and queued > 0)
    rate = preemptions / requests if requests else (1.0 if preemptions else 0.0)
    if rate > policy.shed_rate or full_and_waiting:
        rec = "shed"
    elif rate > policy.backoff_rate or (free_ratio is not None
                                        and free_ratio < policy.backoff_free_ratio):
        rec = "backoff"
    else:
        rec = "ok"
    return {
        "window_s": window_s,
        "preemption_rate": rate,
        "preemptions": preemptions,
        "requests": requests,
        "free_block_ratio": free_ratio,
        "waiting": waiting,
        "engines": live,
        "recommendation": rec,
    }
