"""What a run did, from kvscope's per-request rows, and how far the twin is from it.

A server's run and the twin's replay of it are measured the same way: per-request
outcome records (the columns of the saved query ``replay_traffic``, which reads them from
``request_traces`` and ``request_events``; ``outcome_records`` builds the same records in
Python from the rows the RequestTracker emits), then ``figures`` over those records. So
the fidelity error compares like with like: the server's records against the records
kvscope makes of the twin replaying them.

What the twin cannot reproduce: the model's real step times. The replay adds each request
in the step it arrived in on the server, so the steps a request arrives and runs in are
exact while the server's own batching matched; where they part (the server's tokenizer
or sampler stopping a request the twin runs on, a request aborted mid-way, prefix-cache
hits the replay cannot rebuild), every later arrival meets a different queue, and the
error shows it in every figure at once. Wall-clock arrival (``arrival_s``, ``arrival_ts``
without step columns) is turned into steps at one fixed step time, so there the error
also measures how much the real step times varied.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

FIGURES = ("preemptions", "preempted_requests", "recomputed_tokens", "peak_used_blocks",
           "waited_requests")
LABELS = {"preemptions": "preemptions", "preempted_requests": "preempted requests",
          "recomputed_tokens": "recomputed tokens", "peak_used_blocks": "peak used blocks",
          "waited_requests": "requests that waited to be admitted"}
OUTCOME_KEYS = ("preempt_count", "recomputed_tokens", "admitted_step", "min_free_blocks")
"""The record keys ``figures`` reads besides ``arrival_step``: a replay file with all of
them is a recorded run the twin can be checked against."""
TOLERANCE = 0.10
"""The gate: every figure within 10% of the server's (and at most 1 apart below 10)."""
_GIVES_BLOCKS = ("admitted", "resumed", "allocated")


@dataclass(frozen=True)
class Figures:
    preemptions: int
    preempted_requests: int
    recomputed_tokens: int
    peak_used_blocks: int | None
    """Usable blocks minus the fewest free blocks after a step that gave out blocks;
    None when no record says how many were free."""
    waited_requests: int
    """Requests first admitted in a later step than the one they arrived in."""

    def get(self, name: str) -> int | None:
        return getattr(self, name)


def figures(records: Sequence[dict[str, Any]], usable_blocks: int) -> Figures:
    """The five figures of ``records`` (replay_traffic rows) on a pool of
    ``usable_blocks`` blocks (the null block excluded)."""
    free = [r["min_free_blocks"] for r in records if r.get("min_free_blocks") is not None]
    return Figures(
        preemptions=sum(int(r["preempt_count"]) for r in records),
        preempted_requests=sum(int(r["preempt_count"]) > 0 for r in records),
        recomputed_tokens=sum(int(r["recomputed_tokens"]) for r in records),
        peak_used_blocks=usable_blocks - min(free) if free else None,
        waited_requests=sum(r.get("admitted_step") is not None
                            and r["admitted_step"] > r["arrival_step"] for r in records))


def has_outcomes(records: Sequence[dict[str, Any]]) -> bool:
    """True when every record says what the server did with it."""
    return bool(records) and all(k in r for r in records for k in OUTCOME_KEYS)


def outcome_records(rows: Iterable[Any]) -> list[dict[str, Any]]:
    """``replay_traffic`` records from RequestTrace, RequestEvent and RequestAllocations
    rows, in the query's order (arrival step, then the order the scheduler queued the
    step's arrivals)."""
    from kvscope.rows import RequestEvent, RequestTrace, unrolled

    steps: dict[str, dict[str, Any]] = {}
    traces: list[RequestTrace] = []
    for row in unrolled(rows):
        if isinstance(row, RequestTrace):
            traces.append(row)
        elif isinstance(row, RequestEvent):
            seen = steps.setdefault(row.request_id, {})
            if row.event in ("queued", "admitted") and row.event not in seen:
                seen[row.event] = row.step - 1
            if row.event == "queued":
                facts = dict(kv.partition("=")[::2] for kv in row.detail.split())
                seen["position"] = int(facts.get("position", 0))
                seen["priority"] = int(facts.get("priority", 0))
            if row.event in ("finished", "aborted"):
                seen["finished"] = max(seen.get("finished", row.step - 1), row.step - 1)
            if row.event in _GIVES_BLOCKS and row.free_blocks >= 0:
                seen["free"] = min(seen.get("free", row.free_blocks), row.free_blocks)
    out = []
    for t in traces:
        seen = steps.get(t.request_id, {})
        if "queued" not in seen:
            continue
        out.append({"request_id": t.request_id, "engine": t.engine,
                    "prompt_len": t.prompt_len, "output_len": t.output_len,
                    "max_gen_len": t.max_gen_len, "priority": seen.get("priority", 0),
                    "arrival_step": seen["queued"],
                    "admitted_step": seen.get("admitted"),
                    "finished_step": seen.get("finished"),
                    "preempt_count": t.preempt_count,
                    "recomputed_tokens": t.recomputed_tokens,
                    "cached_tokens": t.cached_tokens, "min_free_blocks": seen.get("free"),
                    "finish_reason": t.finish_reason, "_at": seen.get("position", 0)})
    out.sort(key=lambda r: (r["arrival_step"], r.pop("_at"), r["request_id"]))
    return out


@dataclass(frozen=True)
class Fidelity:
    """The server's figures next to the twin's replay of the same traffic."""

    setting: str
    recorded: Figures
    replayed: Figures
    tolerance: float = TOLERANCE

    def error(self, name: str) -> int | None:
        """Twin minus server; None where either side is unknown."""
        r, t = self.recorded.get(name), self.replayed.get(name)
        return None if r is None or t is None else t - r

    def allowed(self, name: str) -> int:
        """The largest error the gate lets through for ``name``."""
        return max(1, int(self.tolerance * (self.recorded.get(name) or 0)))

    def failing(self) -> list[str]:
        """Figures whose error the gate does not let through (unknown ones included)."""
        return [n for n in FIGURES
                if (e := self.error(n)) is None or abs(e) > self.allowed(n)]

    @property
    def trusted(self) -> bool:
        return not self.failing()

    def as_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "tolerance": self.tolerance,
                "trusted": self.trusted, "failing": self.failing(),
                "figures": {n: {"recorded": self.recorded.get(n),
                                "replayed": self.replayed.get(n), "error": self.error(n),
                                "allowed": self.allowed(n)} for n in FIGURES}}
