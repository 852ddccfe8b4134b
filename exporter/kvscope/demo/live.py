"""The demo's live terminal view, drawn from the sidecar's ``/metrics`` (what Prometheus
scrapes) and the SDK clients' own state.

On a terminal a block of lines is redrawn in place about twice a second (ANSI cursor-up,
no curses); otherwise one summary line is printed every five seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscope.demo.workload import CLIENT_CONFIG, PERSONAS, Workload

BAR_WIDTH = 24
SAMPLE_S = 0.5
"""Seconds between reads of /metrics (and redraws on a terminal)."""
LOG_REFRESH_S = 5.0


class Scrape:
    """One parsed Prometheus exposition."""

    def __init__(self, text: str) -> None:
        self.samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((s.labels, s.value))

    def value(self, name: str, **labels: str) -> float | None:
        """The first sample of ``name`` whose labels include ``labels``, or None."""
        for have, v in self.samples.get(name, ()):
            if all(have.get(k) == w for k, w in labels.items()):
                return v
        return None

    def total(self, name: str, **labels: str) -> float:
        return sum(v for have, v in self.samples.get(name, ())
                   if all(have.get(k) == w for k, w in labels.items()))

    def by(self, name: str, label: str, **where: str) -> dict[str, float]:
        """Samples of ``name`` summed by ``label``, of those whose labels match ``where``."""
        out: dict[str, float] = {}
        for have, v in self.samples.get(name, ()):
            if all(have.get(k) == want for k, want in where.items()):
                out[have.get(label, "")] = out.get(have.get(label, ""), 0.0) + v
        return out


@dataclass
class Trend:
    """Gauges sampled at each refresh, for the findings (a gauge has no history)."""

    tail_waste: list[float] = field(default_factory=list)
    occupancy: list[float] = field(default_factory=list)
    peak_waiting: float = 0.0

    def add(self, s: Scrape) -> None:
        running = s.value("vllm_scheduler_running_requests") or 0
        waste = s.value("vllm_scheduler_tail_waste_tokens")
        if running and waste is not None:
            self.tail_waste.append(waste)
            occ = s.value("vllm_scheduler_kv_token_occupancy_ratio")
            if occ is not None:
                self.occupancy.append(occ)
        self.peak_waiting = max(self.peak_waiting,
                                s.value("vllm_scheduler_waiting_requests") or 0)


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def bar(used: float, cached: float, total: float, width: int = BAR_WIDTH) -> str:
    """``#`` used, ``+`` free but holding prefix-cache data (evictable), ``.`` free."""
    if total <= 0:
        return "[" + " " * width + "]"
    u = round(width * used / total)
    c = min(width - u, round(width * cached / total))
    return "[" + "#" * u + "+" * c + "." * (width - u - c) + "]"


class SdkEvents(logging.Handler):
    """Keeps the SDK's log lines (circuit opened, ...) for the view instead of stderr,
    where they would tear the redrawn block."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((time.monotonic(), record.getMessage().removeprefix(
            "kvscope client: ")))

    @contextlib.contextmanager
    def installed(self) -> Iterator[SdkEvents]:
        log = logging.getLogger("kvscope.client")
        saved = log.propagate, log.level
        log.addHandler(self)
        log.propagate, log.level = False, logging.INFO
        try:
            yield self
        finally:
            log.removeHandler(self)
            log.propagate, log.level = saved


def _pool_lines(s: Scrape) -> list[str]:
    g = s.value
    total = g("vllm_scheduler_total_blocks")
    if g("kvscope_ledger_synced") != 1 or total is None:
        return ["  blocks     (ledger not in sync yet: waiting for a keyframe)", ""]
    used = g("vllm_scheduler_used_blocks") or 0
    cached = g("vllm_scheduler_cached_evictable_blocks") or 0
    occ = g("vllm_scheduler_kv_token_occupancy_ratio")
    return [f"  blocks     {bar(used, cached, total)} free "
            f"{_n(g('vllm_scheduler_free_blocks'))}/{total:.0f} (cached {cached:.0f})  "
            f"max run {_n(g('vllm_scheduler_max_contiguous_free_blocks'))}",
            f"  waste      tail {_n(g('vllm_scheduler_tail_waste_tokens'))} tokens, occupancy "
            f"{'-' if occ is None else f'{occ:.0%}'}, queue head needs "
            f"{_n(g('vllm_scheduler_waiting_head_blocks_needed'))} blocks"]


class LiveView:
    def __init__(self, sidecar: str, engine: str, workload: Workload,
                 out: TextIO | None = None, tty: bool | None = None) -> None:
        self.sidecar = sidecar
        self.engine = engine
        self.workload = workload
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.trend = Trend()
        self.last: Scrape | None = None
        self.started = time.monotonic()
        self.events = SdkEvents()
        self._drawn = 0
        self._told = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Sample and redraw until ``stop`` is set, then once more."""
        with self.events.installed():
            await self._loop(stop)

    async def _loop(self, stop: asyncio.Event) -> None:
        printed = 0.0
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as http:
            while True:
                final = stop.is_set()
                await self.sample(http)
                now = time.monotonic()
                if self.tty:
                    self._redraw(self.lines())
                else:
                    self._tell_events()
                    if final or now - printed >= LOG_REFRESH_S:
                        printed = now
                        print(self.line(), file=self.out, flush=True)
                if final:
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), SAMPLE_S)

    async def sample(self, http: httpx.AsyncClient) -> None:
        try:
            self.last = Scrape((await http.get(f"{self.sidecar}/metrics")).text)
            self.trend.add(self.last)
        except (httpx.HTTPError, ValueError):
            pass  # keep the previous reading; the sidecar answers again soon

    def _tell_events(self) -> None:
        for at, msg in self.events.messages[self._told:]:
            print(f"[{at - self.started:5.1f} s] client SDK: {msg}", file=self.out)
        self._told = len(self.events.messages)

    def _redraw(self, lines: list[str]) -> None:
        # A wrapped line would throw the cursor-up count off: cut to the terminal's width.
        cols = max(20, shutil.get_terminal_size().columns - 1)
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.out.write(up + "".join(f"\x1b[2K{ln[:cols]}\n" for ln in lines))
        self.out.flush()
        self._drawn = len(lines)

    def lines(self) -> list[str]:
        s, w = self.last, self.workload
        t = time.monotonic() - self.started
        head = f"kvscope demo | {self.engine} engine | {t:5.1f} s | {self.sidecar}/ui"
        if s is None:
            return [head, "  waiting for the sidecar's first answer..."]
        g = s.value
        pre = s.by("vllm_scheduler_preempted_requests_total", "reason")
        util = g("vllm_scheduler_token_budget_utilization")
        out = [head,
               f"  scheduler  step {_n(g('vllm_scheduler_steps_total'))}  running "
               f"{_n(g('vllm_scheduler_running_requests'))}  waiting "
               f"{_n(g('vllm_scheduler_waiting_requests'))}  budget used "
               f"{'-' if util is None else f'{util:.1%}'} (10 s)"]
        out += _pool_lines(s)
        failed = sum(t.failed for t in w.tallies.values())
        out += [f"  preempted  {sum(pre.values()):.0f} (" + ", ".join(
                    f"{k} {v:.0f}" for k, v in sorted(pre.items())) + "), recomputed "
                f"{_n(g('vllm_scheduler_recomputed_tokens_total'))} tokens",
                f"  requests   {w.done}/{w.total} answered, {failed} failed, "
                f"{_n(g('kvscope_client_traces_joined_total'))} traces joined to a client"]
        out += self._client_lines()
        if self.events.messages:
            at, msg = self.events.messages[-1]
            out.append(f"  last SDK event ({at - self.started:.1f} s): {msg}"[:160])
        return out

    def _client_lines(self) -> list[str]:
        out = ["  client           answered  pressure          circuit   refused"]
        for p in PERSONAS:
            st, t = self.workload.clients[p.client_id].state(), self.workload.tallies[p.client_id]
            if t.done == t.planned:
                doing = "done"
            elif st.pressure is None:
                doing = "no evidence yet"
            else:
                verb = "backing off" if st.pressure > CLIENT_CONFIG.backoff_threshold else "sending"
                doing = f"{st.pressure:3.0%} {verb}"
            out.append(f"  {p.client_id:<16} {t.done:4d}/{t.planned:<4d} {doing:<17} "
                       f"{st.breaker.state:<9} {t.refused:7d}")
        return out

    def line(self) -> str:
        """The one-line form, for logs."""
        s, w = self.last, self.workload
        t = time.monotonic() - self.started
        if s is None:
            return f"[{t:5.1f} s] waiting for the sidecar"
        g = s.value
        free = g("vllm_scheduler_free_blocks") if g("kvscope_ledger_synced") == 1 else None
        return (f"[{t:5.1f} s] step {_n(g('vllm_scheduler_steps_total'))} running "
                f"{_n(g('vllm_scheduler_running_requests'))} waiting "
                f"{_n(g('vllm_scheduler_waiting_requests'))} free blocks {_n(free)}/"
                f"{_n(g('vllm_scheduler_total_blocks'))} max contiguous "
                f"{_n(g('vllm_scheduler_max_contiguous_free_blocks'))} preemptions "
                f"{s.total('vllm_scheduler_preempted_requests_total'):.0f} answered "
                f"{w.done}/{w.total} refused {sum(x.refused for x in w.tallies.values())}")
