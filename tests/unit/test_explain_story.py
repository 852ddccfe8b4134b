"""A request's story from its lifecycle events when it ended while waiting or preempted:
vLLM aborts such requests (``_free_request`` from the waiting queue, or a preempted one),
and its time until the end is time it waited or sat preempted."""

from __future__ import annotations

from kvscope.explain.story import Span, build


def ev(event: str, step: int, ts: float, tokens: int = 0, detail: str = "") -> dict:
    return {"request_id": "r", "model": "m", "server": "", "engine": "0", "event": event,
            "step": step, "ts": ts, "tokens": tokens, "detail": detail}


def test_a_request_aborted_while_it_waited_waited_until_its_end() -> None:
    """It read "waited 0.000 s (0%)", the whole of it outside the engine."""
    s = build([ev("queued", 1, 0.0), ev("aborted", 50, 40.0)])
    assert s.waiting == Span(40.0, 49) and s.total == Span(40.0, 49)
    assert s.running == Span() and s.preempted == Span()


def test_a_request_aborted_while_preempted_was_preempted_until_its_end() -> None:
    """Its preempted time was counted as running."""
    s = build([ev("queued", 0, 0.0), ev("admitted", 1, 1.0),
               ev("preempted", 2, 2.0, 100, "requester=x blocks_needed=3"),
               ev("aborted", 30, 30.0)])
    assert s.waiting == Span(1.0, 1) and s.preempted == Span(28.0, 28)
    assert s.running == Span(1.0, 1) and s.total == Span(30.0, 30)
    assert s.recomputing == Span()


def test_a_recompute_cut_short_by_another_preemption_ends_there() -> None:
    """Preempted again before it had its tokens back: the first recompute ran from its
    resume to the second preemption. It was taken to run until an event after the second
    resume (9 steps, the second preempted interval among them) where it ran 1."""
    s = build([ev("queued", 0, 0.0), ev("admitted", 1, 1.0, 16),
               ev("preempted", 5, 5.0, 1000, "requester=x blocks_needed=3"),
               ev("resumed", 8, 8.0, 512),
               ev("preempted", 9, 9.0, 512, "requester=x blocks_needed=3"),
               ev("resumed", 15, 15.0, 1000), ev("finished", 20, 20.0, 1100)])
    assert s.preempted == Span(9.0, 9)
    assert s.recomputing == Span(1.0, 2)  # s8, cut at s9 (1 s); s15, back at once
    assert s.recomputing.steps <= s.running.steps == 10
