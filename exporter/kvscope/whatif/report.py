"""``kvscope whatif`` output: a side-by-side table, JSON, CSV, and bar charts as a PNG.

Everything here is a pure function of the settings and their measurements minus wall
time, so one seed gives byte-identical output; wall time is reported apart (``timings``).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscope.whatif.measure import Measurement
from kvscope.whatif.recorded import FIGURES, LABELS, Fidelity
from kvscope.whatif.settings import Setting, format_groups


@dataclass(frozen=True)
class Report:
    workload: str
    """One line saying what ran (synthetic mix or replayed file)."""
    columns: list[tuple[Setting, Measurement]]
    notes: list[str] = field(default_factory=list)
    fidelity: Fidelity | None = None
    """The twin's replay under the server's settings against what the server recorded."""
    left_out: dict[str, int] | None = None
    """Requests of the engine the replayed window left out (JSON ``left_out``:
    ``started_before``, ``not_ended``, ``not_queued``); None when not a stored window's."""


def record(s: Setting, m: Measurement) -> dict[str, Any]:
    """One setting and what kvscope measured under it, flat, without wall time."""
    c = s.config
    return {
        "setting": s.name, "capacity": s.capacity, "block_size": c.block_size,
        "num_blocks": c.num_blocks, "usable_kv_tokens": (c.num_blocks - 1) * c.block_size,
        "max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
        "max_num_scheduled_tokens": c.max_num_scheduled_tokens or c.max_num_batched_tokens,
        "policy": c.policy, "prefix_caching": c.enable_prefix_caching,
        "layout": c.layout, "groups": format_groups(c.groups),
        "sliding_window": c.sliding_window,
        "async_scheduling": c.async_scheduling,
        "num_speculative_tokens": c.num_speculative_tokens,
        "requests": m.requests, "finished": m.finished,
        "preemptions": m.preemptions_total,
        **{f"preemptions_{k}": v for k, v in sorted(m.preemptions.items())},
        "preemption_rate": round(m.preemption_rate, 6),
        "preempted_tokens": m.preempted_tokens, "recomputed_tokens": m.recomputed_tokens,
        "tail_waste_mean_tokens": round(m.tail_waste_mean, 3),
        "tail_waste_peak_tokens": m.tail_waste_peak,
        "tail_waste_pct_of_allocated": round(100 * m.tail_waste_ratio, 3),
        "peak_used_blocks": m.peak_used_blocks, "usable_blocks": m.usable_blocks,
        "peak_used_pct": round(100 * m.peak_used_blocks / m.usable_blocks, 3)
        if m.usable_blocks else 0.0,
        "blocks_per_request": round(m.mean_blocks_per_request, 3),
        "steps_to_drain": m.steps, "drained": m.drained,
        "mean_budget_utilization_pct": round(100 * m.mean_budget_utilization, 3),
        "faults": m.faults,
    }


def _pct(v: float) -> str:
    return f"{v:.1f}%"


Row = tuple[str, Callable[[dict[str, Any]], str]]
ROWS: list[Row] = [
    ("block size (tokens)", lambda r: str(r["block_size"])),
    ("pool blocks (null block included)", lambda r: str(r["num_blocks"])),
    ("pool token slots (usable blocks x block size)", lambda r: str(r["usable_kv_tokens"])),
    ("max seqs", lambda r: str(r["max_num_seqs"])),
    ("token budget per step", lambda r: str(r.get("max_num_scheduled_tokens",
                                                  r["max_num_batched_tokens"]))),
    ("policy", lambda r: r["policy"]),
    ("prefix caching", lambda r: "on" if r["prefix_caching"] else "off"),
    ("KV layout", lambda r: r["layout"] + (f" ({r['sliding_window']})" if "sliding"
                                           in r["layout"] else "")
     + (f" {r['groups']}" if r.get("groups") else "")),
    ("scheduler", lambda r: ("async" if r["async_scheduling"] else "sync")
     + (f" +{r['num_speculative_tokens']} drafts" if r["num_speculative_tokens"] else "")),
    ("", lambda r: ""),
    ("preemptions", lambda r: str(r["preemptions"])),
    ("  kv_full", lambda r: str(r["preemptions_kv_full"])),
    ("  priority", lambda r: str(r["preemptions_priority"])),
    ("  unknown", lambda r: str(r["preemptions_unknown"])),
    ("preemptions per request", lambda r: f"{r['preemption_rate']:.3f}"),
    ("computed tokens discarded", lambda r: str(r["preempted_tokens"])),
    ("recomputed tokens", lambda r: str(r["recomputed_tokens"])),
    ("tail waste, mean (tokens)", lambda r: f"{r['tail_waste_mean_tokens']:.1f}"),
    ("tail waste, peak (tokens)", lambda r: str(r["tail_waste_peak_tokens"])),
    ("tail waste, % of allocated slots", lambda r: _pct(r["tail_waste_pct_of_allocated"])),
    ("peak used blocks", lambda r: f"{r['peak_used_blocks']}/{r['usable_blocks']}"),
    ("blocks per request (peak held)", lambda r: f"{r['blocks_per_request']:.2f}"),
    ("steps to drain", lambda r: str(r["steps_to_drain"]) + ("" if r["drained"] else "*")),
    ("mean budget utilization", lambda r: _pct(r["mean_budget_utilization_pct"])),
    ("requests finished", lambda r: f"{r['finished']}/{r['requests']}"),
]


def table(report: Report) -> str:
    records = [record(s, m) for s, m in report.columns]
    cells = [[label] + [fmt(r) for r in records] for label, fmt in ROWS]
    header = [""] + [r["setting"] for r in records]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    lines = [f"workload: {report.workload}"]
    if report.fidelity is not None:
        lines += fidelity_lines(report.fidelity) + [""]
    for row in [header, *cells]:
        text = row[0].ljust(widths[0]) + "".join(
            "  " + cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))
        lines.append(text.rstrip())
    if not all(r["drained"] for r in records):
        lines.append("* stopped at --max-steps with requests still queued or running")
    if any(r["faults"] for r in records):
        lines.append("! kvscope's ledger lost sync in a run; its figures are not exact")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines) + "\n"


def _known(v: int | None) -> str:
    return "?" if v is None else str(v)


def _signed(v: int | None) -> str:
    return "?" if v is None else f"{v:+d}"


def fidelity_lines(f: Fidelity) -> list[str]:
    """The fidelity gate as a small table: server, twin, error, allowed, per figure."""
    rows = [("", "server", "twin", "error", "allowed")] + [
        (LABELS[n], _known(f.recorded.get(n)), _known(f.replayed.get(n)), _signed(f.error(n)),
         f"±{f.allowed(n)}") for n in FIGURES]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"fidelity: the twin replaying the recorded arrivals under setting {f.setting} "
             "against what the server recorded"]
    lines += ["  " + r[0].ljust(widths[0]) + "".join(
        "  " + c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)) for r in rows]
    failing = f.failing()
    lines.append(f"  gate: every figure within {f.tolerance:.0%} of the server's (at least "
                 "±1): " + ("passed, trust the what-if columns" if not failing else
                            "FAILED on " + ", ".join(LABELS[n] for n in failing)
                            + ": the twin does not reproduce this server; read the what-if "
                            "columns as relative at best"))
    return lines


def as_json(report: Report) -> str:
    doc = {"workload": report.workload, "notes": report.notes,
           "fidelity": report.fidelity.as_dict() if report.fidelity else None,
           "settings": [record(s, m) for s, m in report.columns],
           "left_out": report.left_out}
    return json.dumps(doc, indent=2) + "\n"


def as_csv(report: Report) -> str:
    records = [record(s, m) for s, m in report.columns]
    out = io.StringIO()
    if records:
        writer = csv.DictWriter(out, fieldnames=list(records[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
    return out.getvalue()


def timings(report: Report) -> str:
    """Wall time per setting: the one figure that differs between identical runs."""
    return "wall time: " + ", ".join(
        f"{s.name} {m.wall_seconds:.2f} s" for s, m in report.columns)


RENDERERS: dict[str, Callable[[Report], str]] = {"table": table, "json": as_json, "csv": as_csv}


def write_png(report: Report, path: Path) -> tuple[int, int]:
    """Draw one bar chart per metric; returns the image size (width, height)."""
    from kvscope.whatif.chart import draw

    image = draw([record(s, m) for s, m in report.columns], report.workload)
    image.save(path, format="PNG")
    return image.size
