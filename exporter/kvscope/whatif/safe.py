"""``kvscope whatif --safe-concurrency``: the safe concurrency of a traffic, per setting.

Output is a pure function of the settings, the requests and the seed (see
``kvscope.whatif.concurrency``); one seed gives byte-identical output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from kvscope.twin.workload import TwinRequest
from kvscope.whatif.client import Client
from kvscope.whatif.concurrency import MAX_DELAY_STEPS, TRIALS, Answer, safe_concurrency
from kvscope.whatif.settings import Setting


def answers(settings: Sequence[Setting], requests: Sequence[TwinRequest], *, seed: int,
            client: Client | None = None,
            on_done: Callable[[int, Setting, Answer], None] | None = None,
            ) -> list[tuple[Setting, Answer]]:
    """Each setting's answer; ``on_done(index, setting, answer)`` after each (1-based)."""
    out = []
    for i, s in enumerate(settings, 1):
        out.append((s, safe_concurrency(s.config, requests, seed=seed, client=client)))
        if on_done is not None:
            on_done(i, *out[-1])
    return out


def record(s: Setting, a: Answer) -> dict[str, Any]:
    c = s.config
    scanned = sorted({t.concurrency for t in a.trials})
    return {
        "setting": s.name, "capacity": s.capacity, "block_size": c.block_size,
        "num_blocks": c.num_blocks, "layout": c.layout, "max_num_seqs": c.max_num_seqs,
        "safe_concurrency": a.safe,
        "peak_blocks_at_safe": sum(a.peaks[:a.safe]),
        "largest_request_peak_blocks": a.peaks[0] if a.peaks else 0,
        "trials_safe_up_to": a.trials_safe, "preempts_from": a.preempts_from,
        "first_wave_preempts_from": a.first_wave_from,
        "capped_by_max_num_seqs": a.capped,
        "peak_used_blocks_at_trials_safe": max(
            (t.peak_used_blocks for t in a.at(a.trials_safe)), default=0),
        "usable_blocks": c.num_blocks - 1,
        "preempting_trials": {str(n): sum(t.preemptions > 0 for t in a.at(n))
                              for n in scanned},
    }


def describe(client: Client | None) -> str:
    """How the trials delay each arrival, in words."""
    text = f"every arrival 0 to {MAX_DELAY_STEPS} steps late"
    if client is None:
        return text
    return (f"{text}, and held while the recording's client held its requests: "
            f"{len(client.held)} of {client.span} steps, the longest hold "
            f"{client.longest_hold} steps")


def _header(workload: str, gaps: str) -> list[str]:
    return [f"workload: {workload}",
            "safe concurrency: most requests of this traffic in flight at once that no "
            "client timing can make vLLM preempt: its largest requests fit the pool "
            "together, each at its peak (run alone on vLLM's scheduler)",
            "trials: kvscope loadgen --concurrency C sending it in order, on vLLM's "
            f"scheduler, {TRIALS} timing trials per C ({gaps}; neighbours swapped in half "
            "of them); between the two answers the outcome depends on the client's timing"]


def table(workload: str, results: list[tuple[Setting, Answer]], gaps: str) -> str:
    records = [record(s, a) for s, a in results]
    # The band where the answers change: from the lowest safe answer to the highest
    # concurrency at which every trial preempts (all of it: --format json).
    low = max(1, min((r["safe_concurrency"] for r in records), default=1))
    most = max((r["preempts_from"] or r["trials_safe_up_to"] for r in records), default=0)
    rows: list[list[str]] = [
        ["", *(r["setting"] for r in records)],
        ["KV layout", *(r["layout"] for r in records)],
        ["pool blocks (null block included)", *(str(r["num_blocks"]) for r in records)],
        ["safe concurrency (any client timing)", *(str(r["safe_concurrency"])
                                                   for r in records)],
        ["its largest requests at their peak",
         *(f"{r['peak_blocks_at_safe']}/{r['usable_blocks']}" for r in records)],
        ["no preemption in any trial up to", *(
            str(r["trials_safe_up_to"]) + (" (max seqs)" if r["capped_by_max_num_seqs"]
                                           else "") for r in records)],
        ["peak used blocks there (worst trial)",
         *(f"{r['peak_used_blocks_at_trials_safe']}/{r['usable_blocks']}" for r in records)],
        ["every trial preempts from", *("-" if r["preempts_from"] is None
                                        else str(r["preempts_from"]) for r in records)],
        ["first requests alone overflow from", *("-" if r["first_wave_preempts_from"] is None
                                                 else str(r["first_wave_preempts_from"])
                                                 for r in records)],
        [""] * (len(records) + 1),
    ]
    for n in range(low, most + 1):
        rows.append([f"concurrency {n}: trials preempting",
                     *(f"{r['preempting_trials'][str(n)]}/{TRIALS}"
                       if str(n) in r["preempting_trials"] else "" for r in records)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = _header(workload, gaps)
    for row in rows:
        lines.append((row[0].ljust(widths[0]) + "".join(
            "  " + c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))).rstrip())
    full = [r["setting"] for r in records if r["trials_safe_up_to"]
            and r["peak_used_blocks_at_trials_safe"] >= r["usable_blocks"]]
    if full:
        lines.append(f"note: {', '.join(full)}: at the trials' answer a trial filled the "
                     "pool (no block free) without preempting; there is no margin left")
    never = [r["setting"] for r in records if not r["safe_concurrency"]]
    if never:
        lines.append(f"note: {', '.join(never)}: the largest request alone needs more "
                     "blocks than the pool has; no concurrency is safe for every timing")
    return "\n".join(lines) + "\n"


def as_json(workload: str, results: list[tuple[Setting, Answer]],
            client: Client | None) -> str:
    doc = {"workload": workload, "trials": TRIALS, "max_delay_steps": MAX_DELAY_STEPS,
           "client": None if client is None else {
               "concurrency": client.concurrency, "span_steps": client.span,
               "held_steps": len(client.held),
               "longest_hold_steps": client.longest_hold, "gaps": list(client.gaps)},
           "settings": [record(s, a) for s, a in results]}
    return json.dumps(doc, indent=2) + "\n"


def render(fmt: str, workload: str, results: list[tuple[Setting, Answer]],
           client: Client | None = None) -> str:
    """``table`` or ``json`` (``csv``: one row per setting, trials left out)."""
    if fmt == "json":
        return as_json(workload, results, client)
    if fmt == "csv":
        records = [{k: v for k, v in record(s, a).items() if k != "preempting_trials"}
                   for s, a in results]
        head = ",".join(records[0]) if records else ""
        body = [",".join("" if v is None else str(v) for v in r.values()) for r in records]
        return "\n".join([head, *body]) + "\n"
    return table(workload, results, describe(client))
