"""What ``kvscope demo`` found, computed from what the sidecar recorded.

Every figure comes from the sidecar: ``/api/engines``, ``/metrics``,
``/health/preempt-rate`` and the decision-log file it wrote, plus gauges the live view
sampled from ``/metrics`` while the workload ran (a gauge has no history). The embedded
ClickHouse store is not opened here: chDB lets one process open a store, and the sidecar
holds it; its row counts come from ``kvscope_sink_rows_written_total``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from kvscope.demo.live import Scrape, Trend
from kvscope.demo.workload import PREEMPT_RATE_WINDOW_S, Tally, Workload
from kvscope.rows import TABLES
from kvscope.store import SINK_NAME

QUERIES = ("hourly_preemptions", "blocks_needed_vs_free", "preemption_rate_by_client",
           "duplicate_submissions", "tail_waste_by_prompt_len")
SETTLED_TABLES = ("request_traces", "request_events", "scheduler_decisions", "client_requests")
"""Tables whose rows stop coming once the workload is done."""


@dataclass
class Evidence:
    """Everything the findings are computed from."""

    engine: dict[str, Any]
    """The engine's entry of ``/api/engines``."""
    metrics: Scrape
    pressure: dict[str, Any]
    decisions: list[dict[str, Any]]
    """The decision log's lines, parsed."""
    trend: Trend
    tallies: dict[str, Tally]
    circuit_opens: dict[str, int]
    """Times each SDK client's circuit breaker opened."""


def read_decisions(path: Path) -> list[dict[str, Any]]:
    """The decision log's JSON lines (rotated files included), oldest first."""
    out: list[dict[str, Any]] = []
    files = sorted(path.parent.glob(path.name + ".*"), reverse=True) + [path]
    for f in files:
        if f.is_file():
            out += [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
    return out


def settle(base: str, steps: int | None, answered: int, timeout_s: float = 20.0) -> Scrape:
    """Wait until the sidecar has every step, every client event and every row stored.

    Stored means: a trace for every ended request, a client row for every answer, and
    the rows written for per-request tables unchanged over two reads 1.5 s apart
    (the demo's sidecar batches a second at a time; layout and step rows keep coming). Against
    vLLM it also waits for the reconciliation with vLLM's own count to reach 0. Returns
    the last scrape either way; a figure still short at the deadline is shown as it is.
    """
    deadline = time.monotonic() + timeout_s
    before: dict[str, float] | None = None
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        while True:
            s = Scrape(http.get(f"{base}/metrics").text)
            rows = s.by("kvscope_sink_rows_written_total", "table", sink=SINK_NAME)
            settled = {t: rows.get(t, 0.0) for t in SETTLED_TABLES}
            done = (
                (steps is None or (s.value("vllm_scheduler_steps_total") or 0) >= steps)
                and not s.value("vllm_scheduler_running_requests")
                and not s.value("vllm_scheduler_waiting_requests")
                and s.total("kvscope_client_requests_total") >= answered
                and rows.get("request_traces", 0) >= s.total("vllm_scheduler_requests_ended_total")
                and rows.get("client_requests", 0) >= answered
                and not s.value("kvscope_reconciliation_preemptions_diff"))
            if (done and settled == before) or time.monotonic() > deadline:
                return s
            before = settled if done else None
            time.sleep(1.5 if done else 0.25)


def collect(base: str, decision_log: Path, scrape: Scrape, trend: Trend,
            workload: Workload) -> Evidence:
    with httpx.Client(timeout=5.0, trust_env=False) as http:
        engines = http.get(f"{base}/api/engines").json()["engines"]
        pressure = http.get(f"{base}/health/preempt-rate",
                            params={"window": PREEMPT_RATE_WINDOW_S}).json()
    opens = {cid: st.breaker.opens_total for cid, st in workload.states().items()}
    return Evidence(engines[0] if engines else {}, scrape, pressure,
                    read_decisions(decision_log), trend, workload.tallies, opens)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def findings(ev: Evidence) -> list[str]:
    e, m = ev.engine, ev.metrics
    if not e:
        return ["the sidecar saw no engine: nothing to report"]
    pre = e["preemptions"]
    n_pre = sum(pre.values())
    preempted = m.total("kvscope_client_preempted_requests_total")
    ended = sum(e["requests_ended"].values())
    out = [f"preemptions       {n_pre} (" + ", ".join(f"{k} {v}" for k, v in pre.items())
           + f") over {ended} requests; {preempted:.0f} requests were preempted at least once"]
    out += _budget(e) + _contiguity(ev) + _waste(ev)
    out.append(f"recompute cost    {e['preempted_tokens']} computed tokens discarded by "
               f"preemptions, {e['recomputed_tokens']} of them computed again on resume")
    rec = m.value("kvscope_reconciliation_preemptions_diff")
    if rec is not None:
        out.append(f"reconciliation    kvscope's preemption count minus vLLM's own "
                   f"vllm:num_preemptions_total: {rec:.0f} (0 means they agree)")
    return out + _clients(ev) + _stored(ev) + _health(ev)


def _budget(e: dict[str, Any]) -> list[str]:
    zero = e["steps_with_no_free_blocks"]
    if not zero:
        return [f"budget vs blocks  the pool never ran out of free blocks; the token budget "
                f"was {_pct(e['mean_budget_utilization'])} used on average"]
    return [f"budget vs blocks  on the {zero} of {e['steps']} steps with 0 free blocks the "
            f"token budget was {_pct(e['mean_budget_utilization_when_no_free_blocks'])} used "
            f"(all steps: {_pct(e['mean_budget_utilization'])}): memory, not the compute "
            f"budget, was the limit"]


def _contiguity(ev: Evidence) -> list[str]:
    pre = [d for d in ev.decisions if d.get("event") == "preempt"]
    known = [d for d in pre if d.get("blocks_needed") is not None
             and d.get("free_blocks") is not None]
    short = sum(d["blocks_needed"] > d["free_blocks"] for d in known)
    enough = len(known) - short
    low = ev.engine.get("lowest_max_contiguous_free_blocks")
    return [f"contiguity        {short} of {len(pre)} preemptions needed more blocks than "
            f"were free (blocks_needed > free_blocks); {enough} happened with enough free "
            f"blocks in total" + (f", {len(pre) - len(known)} without the facts" if
                                  len(known) < len(pre) else ""),
            "                  " + (
                "so none can be blamed on scattered free blocks" if not enough else
                f"those {enough} had another cause (see their reason)")
            + f": vLLM V1 never needs contiguous blocks (lowest max contiguous free run: {low})"]


def _waste(ev: Evidence) -> list[str]:
    w, occ = ev.trend.tail_waste, ev.trend.occupancy
    if not w:
        return ["tail waste        no sample with running requests"]
    return [f"tail waste        {sum(w) / len(w):.0f} token slots on average (peak {max(w):.0f})"
            f" reserved but unfilled in running requests' last blocks; tokens filled "
            f"{_pct(sum(occ) / len(occ) if occ else None)} of reserved slots "
            f"({len(w)} samples)"]


def _clients(ev: Evidence) -> list[str]:
    m = ev.metrics
    reqs = m.by("kvscope_client_requests_total", "client")
    pre = m.by("kvscope_client_preempted_requests_total", "client")
    dup = m.by("kvscope_client_duplicate_requests_total", "client")
    out = ["clients           client            requests  preempted  rate    duplicates  "
           "circuit opened  calls it refused"]
    for cid, t in ev.tallies.items():
        n = reqs.get(cid, 0.0)
        out.append(f"                  {cid:<17} {n:8.0f}  {pre.get(cid, 0):9.0f}  "
                   f"{_pct(pre.get(cid, 0) / n if n else None):>6}  {dup.get(cid, 0):10.0f}"
                   f"  {ev.circuit_opens.get(cid, 0):14d}  {t.refused:16d}")
    joined = m.total("kvscope_client_traces_joined_total")
    unjoined = m.total("kvscope_client_traces_unjoined_total")
    total = joined + unjoined
    p = ev.pressure
    out += [f"                  {sum(dup.values()):.0f} duplicate submissions flagged (same "
            f"client, same prompt hash within 10 s); {joined:.0f} of {total:.0f} engine "
            f"traces joined to their client ({_pct(joined / total if total else None)})",
            f"                  /health/preempt-rate now: rate {p.get('preemption_rate', 0):.2f}"
            f" over {p.get('window_s', 0):.0f} s, recommendation {p.get('recommendation')}"]
    return out


def _stored(ev: Evidence) -> list[str]:
    # the ClickHouse sink's rows only: the decision log counts its lines under the same
    # table name (scheduler_decisions was shown twice its stored rows)
    rows = ev.metrics.by("kvscope_sink_rows_written_total", "table", sink=SINK_NAME)
    events = Counter(d.get("event") for d in ev.decisions)
    return [
        "stored            ClickHouse rows: " + ", ".join(
            f"{t} {rows.get(t, 0):.0f}" for t in TABLES),
        f"                  decision log: {len(ev.decisions)} lines (" + ", ".join(
            f"{k} {v}" for k, v in events.most_common()) + ")",
    ]


def _health(ev: Evidence) -> list[str]:
    m = ev.metrics
    steps = m.total("vllm_scheduler_steps_total")
    cost = m.total("kvscope_probe_overhead_seconds_total")
    dropped = m.total("kvscope_probe_records_dropped_total")
    return [f"kvscope itself    probe records dropped {dropped:.0f}, ledger gaps "
            f"{m.total('kvscope_ledger_gaps_total'):.0f}, ledger mismatches "
            f"{m.total('kvscope_ledger_mismatches_total'):.0f}, sink rows dropped "
            f"{m.total('kvscope_sink_rows_dropped_total'):.0f}; probe cost "
            f"{1e6 * cost / steps if steps else 0:.0f} us per step"]


def kvscope_command() -> str:
    """How the user ran kvscope, to print commands they can paste."""
    argv0 = sys.argv[0]
    if Path(argv0).name == "kvscope":
        return shlex.quote(argv0)
    return f"{shlex.quote(sys.executable)} -m kvscope"


def most_preempted(decisions: list[dict[str, Any]]) -> tuple[str, int] | None:
    """The request the decision log shows preempted most (the first ID of a tie), and
    how many times; None when nothing was preempted."""
    counts = Counter(d["request_id"] for d in decisions if d.get("event") == "preempt")
    if not counts:
        return None
    rid = min(counts, key=lambda r: (-counts[r], r))
    return rid, counts[rid]


def explain_page(base: str, rid: str) -> str:
    """The sidecar's ``kvscope explain`` page of ``rid`` (any ID: percent-encoded)."""
    return f"{base}/ui/requests/{quote(rid, safe='')}"


def next_steps(base: str, data_dir: Path, decision_log: Path,
               slowest: tuple[str, int] | None = None) -> list[str]:
    """What to open or run next; ``slowest``: the most preempted request (``most_preempted``),
    whose story ``kvscope explain`` tells."""
    dsn = shlex.quote(f"chdb://{data_dir / 'chdb'}")
    cmd = kvscope_command()
    explain = []
    if slowest is not None:
        rid, n = slowest
        explain = [f"explain  {explain_page(base, rid)}   why request {rid} was slow "
                   f"(preempted {n} times), live",
                   f"         {cmd} explain {shlex.quote(rid)} --dsn {dsn}   the same, once "
                   "the demo has stopped",
                   f"         {cmd} explain --worst 5 --dsn {dsn}   the requests "
                   "that lost the most time"]
    return [
        f"pages    {base}/ui                    the KV block layout, live",
        f"         {base}/metrics               what Prometheus scrapes",
        f"         {base}/api/engines           the sidecar's summary as JSON",
        f"         {base}/health/preempt-rate   what the clients' backpressure reads",
        *explain,
        "queries  (once the demo has stopped: chDB lets one process open a store)",
        *(f"         {cmd} query {q} --dsn {dsn}" for q in QUERIES),
        f"log      grep '\"event\":\"preempt\"' {shlex.quote(str(decision_log))}",
        '         in Loki: {job="kvscope"} |= "Preempting request"',
    ]
