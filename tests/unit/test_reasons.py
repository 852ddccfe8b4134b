"""Preemption reasons come from facts only."""

from __future__ import annotations

from kvscope_probe.reasons import classify


def c(**kw: object) -> str:
    base = dict(policy="fcfs", in_schedule=True, victim="v", victim_priority=0,
                requester="r", requester_priority=0, blocks_needed=3, free_blocks=1)
    base.update(kw)
    return classify(**base)  # type: ignore[arg-type]


def test_failed_allocation_larger_than_free_is_kv_full() -> None:
    assert c() == "kv_full"
    assert c(requester="v") == "kv_full"  # a request that preempts itself


def test_priority_needs_a_strictly_higher_priority_requester() -> None:
    assert c(policy="priority", victim_priority=2, requester_priority=0) == "priority"
    assert c(policy="priority", victim_priority=0, requester_priority=0) == "kv_full"
    assert c(policy="priority", requester="v", victim_priority=2, requester_priority=2) == "kv_full"
    assert c(policy="fcfs", victim_priority=2, requester_priority=0) == "kv_full"


def test_anything_unexplained_is_unknown_never_guessed() -> None:
    assert c(in_schedule=False) == "unknown"  # e.g. a prefix-cache reset
    assert c(requester=None) == "unknown"
    assert c(blocks_needed=None) == "unknown"
    assert c(blocks_needed=1, free_blocks=1) == "unknown"  # enough blocks were free
