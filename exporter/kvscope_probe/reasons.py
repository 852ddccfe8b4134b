"""Why a request was preempted, derived only from recorded facts.

vLLM V1 preempts inside ``Scheduler.schedule()`` when ``allocate_slots`` for a running
request returns ``None`` because the blocks it needs exceed the free blocks (evictable
prefix-cache blocks count as free). No contiguity is ever required, so contiguity is
never a reason here. The victim is ``running[-1]`` under fcfs and the running request
with the largest ``(priority, arrival_time)`` under the priority policy.

- ``kv_full``: the failed allocation needed more blocks than were free.
- ``priority``: as kv_full, and the victim was displaced for a request of strictly higher
  priority (a smaller priority value) under the priority policy.
- ``unknown``: the probe saw no failed allocation that explains it (for example a
  prefix-cache reset that preempts every running request). Never guessed.
"""

from __future__ import annotations


def classify(
    *,
    policy: str,
    in_schedule: bool,
    victim: str,
    victim_priority: int,
    requester: str | None,
    requester_priority: int | None,
    blocks_needed: int | None,
    free_blocks: int,
) -> str:
    """The preemption reason for one victim; see the module docstring."""
    if not in_schedule or requester is None or blocks_needed is None:
        return "unknown"
    if blocks_needed <= free_blocks:
        return "unknown"
    if (
        policy == "priority"
        and requester != victim
        and requester_priority is not None
        and victim_priority > requester_priority
    ):
        return "priority"
    return "kv_full"
