"""``kvscope whatif --safe-concurrency``: the safe concurrency of a traffic, per setting.

Output is a pure function of the settings, the requests and the seed (see
``kvscope.whatif.concurrency``); one seed gives byte-identical output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from kvscope.twin.workload import TwinRequest
from kvscope.whatif.concurrency import MAX_DELAY_STEPS, TRIALS, Answer, safe_concurrency
from kvscope.whatif.settings import Setting


def answers(settings: Sequence[Setting], requests: Sequence[TwinRequest], *, seed: int,
            on_done: Callable[[int, Setting, Answer], None] | None = None,
            ) -> list[tuple[Setting, Answer]]:
    """Each setting's answer; ``on_done(index, setting, answer)`` after each (1-based)."""
    out = []
    for i, s in enumerate(settings, 1):
        out.append((s, safe_concurrency(s.config, requests, seed=seed)))
        if on_done is not None:
            on_done(i, *out[-1])
    return out


def record(s: Setting, a: Answer) -> dict[str, Any]:
    c = s.config
    scanned = sorted({t.concurrency for t in a.trials})
    return {
        "setting": s.name, "capacity": s.capacity, "block_size": c.block_size,
        "num_blocks": c.num_blocks, "layout": c.layout, "max_num_seqs": c.max_num_seqs,
        "safe_concurrency": a.safe, "preempts_from": a.preempts_from,
        "first_wave_preempts_from": a.first_wave_from,
        "capped_by_max_num_seqs": a.capped,
        "peak_used_blocks_at_safe": max((t.peak_used_blocks for t in a.at(a.safe)),
                                        default=0),
        "usable_blocks": c.num_blocks - 1,
        "preempting_trials": {str(n): sum(t.preemptions > 0 for t in a.at(n))
                              for n in scanned},
    }


def _header(workload: str) -> list[str]:
    return [f"workload: {workload}",
            "safe concurrency: most requests of this traffic in flight at once (as kvscope "
            "loadgen --concurrency sends them, in order) with no preemption on vLLM's "
            f"scheduler, in any of {TRIALS} timing trials (the next request arriving 0 to "
            f"{MAX_DELAY_STEPS} steps after one ends, neighbours swapped in half of them), "
            "nor at any lower concurrency"]


def table(workload: str, results: list[tuple[Setting, Answer]]) -> str:
    records = [record(s, a) for s, a in results]
    # The band where the answers change: from the lowest safe answer to the highest
    # concurrency at which every trial preempts (all of it: --format json).
    low = max(1, min((r["safe_concurrency"] for r in records), default=1))
    most = max((r["preempts_from"] or r["safe_concurrency"] for r in records), default=0)
    rows: list[list[str]] = [
        ["", *(r["setting"] for r in records)],
        ["KV layout", *(r["layout"] for r in records)],
        ["pool blocks (null block included)", *(str(r["num_blocks"]) for r in records)],
        ["safe concurrency", *(str(r["safe_concurrency"])
                               + (" (max seqs)" if r["capped_by_max_num_seqs"] else "")
                               for r in records)],
        ["every trial preempts from", *("-" if r["preempts_from"] is None
                                        else str(r["preempts_from"]) for r in records)],
        ["first requests alone overflow from", *("-" if r["first_wave_preempts_from"] is None
                                                 else str(r["first_wave_preempts_from"])
                                                 for r in records)],
        ["peak used blocks at safe (worst trial)",
         *(f"{r['peak_used_blocks_at_safe']}/{r['usable_blocks']}" for r in records)],
        [""] * (len(records) + 1),
    ]
    for n in range(low, most + 1):
        rows.append([f"concurrency {n}: trials preempting",
                     *(f"{r['preempting_trials'][str(n)]}/{TRIALS}"
                       if str(n) in r["preempting_trials"] else "" for r in records)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = _header(workload)
    for row in rows:
        lines.append((row[0].ljust(widths[0]) + "".join(
            "  " + c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))).rstrip())
    full = [r["setting"] for r in records if r["safe_concurrency"]
            and r["peak_used_blocks_at_safe"] >= r["usable_blocks"]]
    if full:
        lines.append(f"note: {', '.join(full)}: at the safe concurrency a trial filled the "
                     "pool (no block free) without preempting; there is no margin left")
    return "\n".join(lines) + "\n"


def as_json(workload: str, results: list[tuple[Setting, Answer]]) -> str:
    doc = {"workload": workload, "trials": TRIALS, "max_delay_steps": MAX_DELAY_STEPS,
           "settings": [record(s, a) for s, a in results]}
    return json.dumps(doc, indent=2) + "\n"


def render(fmt: str, workload: str, results: list[tuple[Setting, Answer]]) -> str:
    """``table`` or ``json`` (``csv``: one row per setting, trials left out)."""
    if fmt == "json":
        return as_json(workload, results)
    if fmt == "csv":
        records = [{k: v for k, v in record(s, a).items() if k != "preempting_trials"}
                   for s, a in results]
        head = ",".join(records[0]) if records else ""
        body = [",".join("" if v is None else str(v) for v in r.values()) for r in records]
        return "\n".join([head, *body]) + "\n"
    return table(workload, results)
