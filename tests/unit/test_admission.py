"""The admission_blocked decision: made for a step that admitted nothing while requests
waited, with the limit vLLM's waiting loop met first."""

from __future__ import annotations

from kvscope.rows import SchedulerDecision
from kvscope.state.hub import Hub
from kvscope.state.requests import RequestTracker
from kvscope_probe import wire
from tests.unit.test_hub import feed, keyframe
from tests.unit.test_wire import hello, step


def all_decisions_after(steps: list[wire.Step]) -> list[SchedulerDecision]:
    """The decisions a tracker makes of ``steps``, fed after a hello and a keyframe of an
    8-block pool (block 0 null)."""
    hub = Hub()
    got: list[SchedulerDecision] = []
    tracker = RequestTracker(lambda r: got.append(r) if isinstance(r, SchedulerDecision)
                             else None)
    hub.listeners.append(tracker.on_event)
    feed(hub, [hello(), step(free_blocks=7), keyframe()], 0)
    feed(hub, list(steps), 3)
    return got


def decisions_after(steps: list[wire.Step]) -> list[SchedulerDecision]:
    """The admission_blocked decisions of ``steps`` (``all_decisions_after``)."""
    return [d for d in all_decisions_after(steps) if d.decision == "admission_blocked"]


def test_a_step_that_took_a_preempted_request_back_admitted_it() -> None:
    """vLLM 0.32 lists a preempted request it takes back from the waiting queue among
    the scheduled cached requests (resumed_req_ids), not the new ones: such a step
    admitted a request, though the head behind it needs more blocks than are free."""
    resumed = step(ops=[(wire.OP_ALLOC, [1, 2])], free_blocks=5, running=1, waiting=2,
                   head_blocks_needed=9, cached_ids=["a"], cached_computed=[0],
                   num_scheduled={"a": 64}, grown_ids=["a"], grown_blocks=[[[1, 2]]],
                   resumed=["a"])
    assert decisions_after([resumed]) == []
    # the same step with nothing taken back: blocked, by the pool
    idle = step(free_blocks=7, running=0, waiting=2, head_blocks_needed=9)
    (d,) = decisions_after([idle])
    assert (d.reason, d.blocks_needed, d.free_blocks) == ("kv_blocks", 9, 7)


def test_a_request_vllm_ended_in_error_is_an_error_decision_not_a_finish() -> None:
    """vLLM ends a request FINISHED_ERROR (a failed KV load, a model error): the decision
    log said "finish" with "Finished request", and a query for failures found nothing."""
    ends = [wire.End(rid, status, 8, 4, 0, 0, 3.0) for rid, status in
            (("ok", "FINISHED_STOPPED"), ("gone", "FINISHED_ABORTED"),
             ("failed", "FINISHED_ERROR"))]
    got = all_decisions_after([step(free_blocks=7, ends=ends)])
    by_id = {d.request_id: (d.decision, d.msg.split(" request ")[0]) for d in got}
    assert by_id == {"ok": ("finish", "Finished"), "gone": ("abort", "Aborted"),
                     "failed": ("error", "Failed")}
