"""One request's story from its lifecycle events: the timeline and where its time went.

Every interval is a difference of two event times of one engine process (the probe's clock)
and a difference of two engine step counters, so the parts add up to the whole exactly:
``waiting + preempted + running == end - queued``; a request that ended (aborted) while
it waited or sat preempted spent the time until its end there. ``recomputing`` is the part of
``running`` spent computing again the tokens a preemption discarded: the steps from each
resume to the one whose computed tokens are back to what it had lost, inclusive, and the
time from the resume to the start of the step after those (``next_step``: the engine's
first event in a later step, as the store knows no step of its own); a recompute cut short
by another preemption ran until that preemption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

END_EVENTS = ("finished", "aborted")


@dataclass
class Span:
    """Seconds and engine steps spent in one state."""

    seconds: float = 0.0
    steps: int = 0

    def add(self, a: dict, b: dict) -> None:
        self.seconds += b["ts"] - a["ts"]
        self.steps += b["step"] - a["step"]

    def as_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 6), "steps": self.steps}


@dataclass
class Preemption:
    """One preemption of the request with the facts recorded just before it."""

    event: dict
    requester: str
    blocks_needed: int
    resumed: dict | None = None
    back: dict | None = None
    """The event at which its recomputation was done (None: never resumed or not seen)."""
    holders: dict | None = None
    """Top holders of the pool as its step began (``holders.top_holders``)."""
    cached_blocks: int = -1
    """Evictable prefix-cache blocks in the last layout sample before (-1: no sample)."""
    layout: dict | None = None
    """The layout sample at or before its step, its blocks marked (``answer.layout_json``)."""
    trigger: dict | None = None
    """The requester's own event in that step (its growth: ``holders.trigger_event``)."""


@dataclass
class Story:
    request_id: str
    model: str
    server: str
    engine: str
    events: list[dict]
    queued: dict | None
    admitted: dict | None
    end: dict | None
    preemptions: list[Preemption]
    waiting: Span
    preempted: Span
    recomputing: Span
    running: Span
    incomplete: list[str]
    """Why its figures are not known (empty: they are): rows the store lacks."""

    @property
    def total(self) -> Span:
        return Span(self.waiting.seconds + self.preempted.seconds + self.running.seconds,
                    self.waiting.steps + self.preempted.steps + self.running.steps)


def facts(detail: str) -> dict[str, str]:
    """``key=value`` pairs of an event's detail."""
    return dict(p.split("=", 1) for p in detail.split() if "=" in p)


def requester(event: dict) -> str:
    """A preemption's requester as vLLM named it: the event's own ``requester``. A row
    written before the store kept it (clickhouse/schema/140) has '' there, and its detail
    is read as it was then (exact unless the ID holds a space, which such rows cannot
    say); so is one the probe named no requester for (its detail names none either)."""
    return event.get("requester") or facts(event["detail"]).get("requester", "")


def build(events: list[dict], next_step: Callable[[int], dict | None] = lambda _s: None,
          preempt_count: int | None = None) -> Story:
    """The story of one request from its events (one engine, in order); ``preempt_count``
    the preemptions vLLM counted (its trace), when known."""
    first = events[0]
    queued = _first(events, "queued")
    admitted = _first(events, "admitted")
    end = next((e for e in reversed(events) if e["event"] in END_EVENTS), None)
    waiting, preempted, recomputing, running = Span(), Span(), Span(), Span()
    if queued and (admitted or end):  # never admitted: it waited until it ended
        waiting.add(queued, admitted or end)  # type: ignore[arg-type]
    pre: list[Preemption] = []
    for i, e in enumerate(events):
        if e["event"] != "preempted":
            continue
        f = facts(e["detail"])  # blocks_needed is its last fact, after any requester text
        p = Preemption(e, requester(e), int(f.get("blocks_needed", "-1")))
        p.resumed = next((x for x in events[i + 1:] if x["event"] == "resumed"), None)
        if p.resumed is None and end is not None and end["step"] >= e["step"]:
            preempted.add(e, end)  # never resumed: preempted until it ended (aborted)
        if p.resumed is not None:
            preempted.add(e, p.resumed)
            j = events.index(p.resumed)
            cut = _first(events[j:], "preempted")  # preempted again before it was back
            until = events[j:events.index(cut)] if cut is not None else events[j:]
            p.back = next((x for x in until if x["tokens"] >= e["tokens"]
                           and x["event"] not in END_EVENTS), None) or _first(
                until, *END_EVENTS)
            if p.back is not None:
                after = next_step(p.back["step"])
                recomputing.steps += p.back["step"] - p.resumed["step"] + 1
                recomputing.seconds += (after or p.back)["ts"] - p.resumed["ts"]
            elif cut is not None:  # its recompute ran until that preemption
                recomputing.add(p.resumed, cut)
        pre.append(p)
    if admitted and end:
        running = Span(end["ts"] - admitted["ts"] - preempted.seconds,
                       end["step"] - admitted["step"] - preempted.steps)
    return Story(first["request_id"], first["model"], first["server"], first["engine"],
                 events, queued, admitted, end, pre, waiting, preempted, recomputing, running,
                 gaps(events, preempt_count))


def gaps(events: list[dict], preempt_count: int | None = None) -> list[str]:
    """What the store lacks for a whole story (rows it never got: the request started
    before the sidecar saw its engine, a run of the sidecar ended in its middle), each
    said; the spans are not figures then, and a missing row must not read as a fact."""
    kinds = [e["event"] for e in events]
    out = []
    if "queued" not in kinds:
        out.append("no queued event (it arrived before the sidecar saw its engine, or the "
                   "row is lost)")
    if "admitted" not in kinds and any(k in kinds for k in (
            "resumed", "allocated", "taken_up", "preempted", "finished")):  # it ran
        out.append("no admitted event")
    if not any(k in END_EVENTS for k in kinds):
        out.append("no end event (not ended yet, or its end was not recorded)")
    if any(b["step"] < a["step"] for a, b in zip(events, events[1:], strict=False)):
        out.append("its events span two runs (step numbers restarted)")
    out_now = False
    for k in kinds:
        if k == "preempted":
            out_now = True
        elif k == "resumed":
            if not out_now:
                out.append("a resume with no preemption before it")
                break
            out_now = False
    found = kinds.count("preempted")
    if preempt_count is not None and preempt_count >= 0 and preempt_count != found:
        out.append(f"vLLM counted {preempt_count} preemption{'s' * (preempt_count != 1)}, "
                   f"the store holds {found}")
    return out


def _first(events: list[dict], *kinds: str) -> dict | None:
    return next((e for e in events if e["event"] in kinds), None)


STATE_AFTER = {"queued": "waiting", "preempted": "preempted", "admitted": "running",
               "resumed": "running", "taken_up": "running", "finished": "", "aborted": ""}


def spans(events: list[dict]) -> list[dict[str, Any]]:
    """The request's states over time (waiting, running, preempted) between its events,
    for the chart: one entry per change of state."""
    out: list[dict[str, Any]] = []
    state, since = "", None
    for e in events:
        nxt = STATE_AFTER.get(e["event"], state)
        if nxt != state or e["event"] in END_EVENTS:
            if state and since is not None:
                out.append({"state": state, "from_ts": since["ts"], "to_ts": e["ts"],
                            "from_step": since["step"], "to_step": e["step"]})
            state, since = nxt, e
    return out
