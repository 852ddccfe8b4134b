"""The client of a recorded closed loop: when it sent each next request after an end.

``kvscope loadgen --concurrency C`` (or any client that keeps C requests in flight) sends
the next request when one ends. How soon it reaches the scheduler is the client's and
the API server's doing, not the engine's: an HTTP round trip and tokenizing take a step
or two, and a client that is starved of CPU (or stops to garbage-collect) holds every
request released meanwhile and then sends them together. On the 2-core CPU server the
load generator's stalls reached hundreds of steps and released up to
four requests in one step. Bursts like these start requests together, so they grow
together: the safe concurrency has to survive them.

From a recording (``replay_traffic`` rows with ``arrival_step`` and ``finished_step``):
C is the most requests it had in flight at once (the client's concurrency: counting the
first C arrivals as the first wave fails when the client sends one of them only after
the first end, as the load generator did once); the k-th end by step released the
(C+k)-th arrival, and the client *held* a request at every step where more requests had
been released than sent. ``Client.send_step`` replays that pattern from any offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Client:
    """Steps (counted from the recording's first end) at which the client held a
    released request, over the ``span`` steps from that end to the last arrival."""

    held: frozenset[int]
    span: int
    concurrency: int
    """The most requests the recording had in flight at once."""
    gaps: tuple[int, ...]
    """Each matched end's steps to its arrival, sorted (``recorded_gaps``)."""

    def send_step(self, released: int, offset: int) -> int:
        """The step a request released at step ``released`` is sent, with the pattern
        replayed from ``offset`` (wrapping around)."""
        step = released
        while (step + offset) % self.span in self.held:  # the span's last step is free
            step += 1
        return step

    @property
    def longest_hold(self) -> int:
        longest = run = 0
        for t in range(self.span):
            run = run + 1 if t in self.held else 0
            longest = max(longest, run)
        return longest


def in_flight(arrivals: Sequence[int], ends: Sequence[int]) -> int:
    """The most requests in flight at once (an end in a step comes before an arrival)."""
    most = now = 0
    for _, change in sorted([(a, 1) for a in arrivals] + [(e, -1) for e in ends]):
        now += change
        most = max(most, now)
    return most


def _matched(records: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], int] | None:
    """(ends, arrivals after the first wave, k-th with k-th; the concurrency); None: no
    ``finished_step`` on every record, or nothing sent after an end."""
    ends = sorted(int(r["finished_step"]) for r in records
                  if r.get("finished_step") is not None)
    if not ends or len(ends) != len(records):
        return None
    arrivals = sorted(int(r["arrival_step"]) for r in records)
    concurrency = in_flight(arrivals, ends)
    later = arrivals[concurrency:]
    if not later:
        return None
    return ends[:len(later)], later, concurrency


def recorded_client(records: Sequence[dict[str, Any]]) -> Client | None:
    """The recording's client (see the module docstring); None when the records cannot
    say (no ``finished_step`` on every record, or no request sent after an end)."""
    matched = _matched(records)
    if matched is None:
        return None
    ends, later, concurrency = matched
    origin, last = ends[0], later[-1]
    held: set[int] = set()
    released = sent = 0
    for t in range(origin, last + 1):
        while released < len(ends) and ends[released] <= t:
            released += 1
        while sent < len(later) and later[sent] <= t:
            sent += 1
        if released > sent:
            held.add(t - origin)
    gaps = tuple(sorted(a - e for e, a in zip(ends, later, strict=True)))
    return Client(frozenset(held), last - origin + 1, concurrency, gaps)


def recorded_gaps(records: Sequence[dict[str, Any]]) -> tuple[int, ...] | None:
    """Steps from each end to the arrival it released, sorted (``Client.gaps``)."""
    client = recorded_client(records)
    return None if client is None else client.gaps
