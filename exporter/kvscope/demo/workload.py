"""The demo's clients: a seeded, mixed workload sent through kvscope's client SDK.

Four simulated applications share one server, each with its own client id and
User-Agent, so layer 5 (client correlation) has something to tell apart: a chat front end
(short prompts), a RAG service (long prompts behind a shared prefix, so the prefix cache
gets hits), a batch summarizer (long prompts) and a retry bot (short prompts, some of
which it sends again a second or two later without waiting for the first answer: the
duplicates kvscope flags). The first three read the sidecar's ``/health/preempt-rate``,
so their backpressure (delays, an open circuit) follows the pool; the bot does not.
Prompts are drawn by :func:`kvscope.twin.generate`, so a seed names the same mix as in
``kvscope whatif``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvscope.client import (
    AsyncKVScopeClient,
    CircuitOpenError,
    ClientConfig,
    ClientState,
    KVScopeClientError,
)
from kvscope.client.sdk import USER_AGENT
from kvscope.http import limits as http_limits
from kvscope.twin import WorkloadSpec, generate
from kvscope.twin.workload import TwinRequest

WAVE_SIZE = 25
"""Requests per wave; waves arrive ``WAVE_INTERVAL_STEPS`` scheduler steps apart."""
WAVE_INTERVAL_STEPS = 300
DUPLICATE_EVERY = 25
"""One request in this many is a retry bot's duplicate submission."""
PREEMPT_RATE_WINDOW_S = 5
"""The window the clients ask /health/preempt-rate for (its shortest)."""
IN_FLIGHT = 256
"""Calls one client has open at once (its connection pool's size)."""
CLIENT_CONFIG = ClientConfig(window_s=5.0, min_samples=5, preempt_rate_poll_s=1.0,
                             open_threshold=0.5, open_after_windows=3,
                             open_duration_s=1.0, max_open_duration_s=4.0)
"""Shorter windows than the SDK's defaults, so backpressure shows within a minute."""


@dataclass(frozen=True)
class Persona:
    client_id: str
    app: str
    """The application's own User-Agent token, sent before the SDK's."""
    reads_sidecar: bool


PERSONAS = (
    Persona("chat-frontend", "chat-frontend/2.3", True),
    Persona("rag-service", "rag-service/0.9", True),
    Persona("batch-summarizer", "summarizer-batch/1.4", True),
    Persona("retry-bot", "retry-bot/0.1", False),
)


@dataclass(frozen=True)
class Job:
    client: str
    prompt: str
    max_tokens: int
    priority: int
    at_s: float
    """Seconds after the workload starts at which the client sends it."""
    resend_after_s: float | None = None
    """The retry bot sends the same prompt again this long after the first send."""


def plan(n_requests: int, seed: int, step_s: float) -> list[Job]:
    """``n_requests`` jobs in all, duplicates included; the same arguments, the same plan."""
    n_dup = n_requests // DUPLICATE_EVERY if n_requests >= 4 else 0
    unique = n_requests - n_dup
    spec = WorkloadSpec(n_requests=unique, seed=seed, waves=max(1, -(-unique // WAVE_SIZE)),
                        wave_interval_steps=WAVE_INTERVAL_STEPS)
    reqs = generate(spec)
    rng = random.Random(seed + 1)
    shared = _shared_prefix(reqs, spec.shared_prefix_len)
    short = [r for r in reqs if len(r.prompt_token_ids) <= spec.short_prompt[1]]
    rng.shuffle(short)
    short_ids = {r.request_id for r in short}
    bots = {r.request_id for r in short[:max(n_dup, len(short) * 3 // 10)]}
    resend = {r.request_id for r in short[:n_dup]}
    jobs = []
    for r in reqs:
        if r.request_id in bots:
            client = "retry-bot"
        elif r.request_id in short_ids:
            client = "chat-frontend"
        elif shared and r.prompt_token_ids[:len(shared)] == shared:
            client = "rag-service"
        else:
            client = "batch-summarizer"
        jobs.append(Job(client, _words(r.prompt_token_ids), r.max_tokens, r.priority,
                        r.arrival_step * step_s + rng.uniform(0.0, 0.5),
                        rng.uniform(0.5, 2.0) if r.request_id in resend else None))
    return sorted(jobs, key=lambda j: j.at_s)


def _shared_prefix(reqs: list[TwinRequest], n: int) -> tuple[int, ...]:
    heads = Counter(r.prompt_token_ids[:n] for r in reqs if len(r.prompt_token_ids) > n)
    head, count = heads.most_common(1)[0] if heads else ((), 0)
    return head if count > 1 else ()


def _words(ids: tuple[int, ...]) -> str:
    return " ".join(f"w{i - 4}" for i in ids)  # the tiny model's vocabulary: wN is N + 4


@dataclass
class Tally:
    """One client's outcomes, as the client saw them."""

    planned: int = 0
    ok: int = 0
    failed: int = 0
    refused: int = 0
    """Calls the SDK's open circuit refused locally (sent again after its retry-after)."""
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def done(self) -> int:
        return self.ok + self.failed


class Workload:
    """Runs a plan against ``base_url`` with one SDK client per persona."""

    def __init__(self, jobs: list[Job], base_url: str, model: str, sidecar_url: str,
                 send_priority: bool) -> None:
        self.jobs = jobs
        self.model = model
        self.send_priority = send_priority
        self.tallies = {p.client_id: Tally() for p in PERSONAS}
        for job in jobs:
            self.tallies[job.client].planned += 1 + (job.resend_after_s is not None)
        rate_url = f"{sidecar_url}/health/preempt-rate?window={PREEMPT_RATE_WINDOW_S}"
        self._http = {p.client_id: _http(p.app) for p in PERSONAS}
        # Calls beyond the pool's connections wait here, not in httpx's pool: httpcore
        # rescans its whole queue of waiting requests at every change, and with 1,000
        # requests queued the event loop ran 24 s late (`kvscope demo --requests 3000
        # --duration 150` was cut off after 221 s).
        self._in_flight = {p.client_id: asyncio.Semaphore(IN_FLIGHT) for p in PERSONAS}
        self.clients = {p.client_id: AsyncKVScopeClient(
            base_url, client_id=p.client_id, config=CLIENT_CONFIG,
            preempt_rate_url=rate_url if p.reads_sidecar else None,
            http=self._http[p.client_id]) for p in PERSONAS}

    @property
    def total(self) -> int:
        return sum(t.planned for t in self.tallies.values())

    @property
    def done(self) -> int:
        return sum(t.done for t in self.tallies.values())

    def states(self) -> dict[str, ClientState]:
        return {cid: c.state() for cid, c in self.clients.items()}

    async def run(self) -> None:
        """Send every job at its time; return when all have an answer."""
        start = time.monotonic()
        try:
            await asyncio.gather(*(self._job(j, start) for j in self.jobs))
        finally:
            for http in self._http.values():
                await http.aclose()  # the SDK leaves a client passed in open

    async def _job(self, job: Job, start: float) -> None:
        await asyncio.sleep(max(0.0, start + job.at_s - time.monotonic()))
        if job.resend_after_s is None:
            await self._send(job)
            return

        async def resend() -> None:
            await asyncio.sleep(job.resend_after_s or 0.0)
            await self._send(job)

        await asyncio.gather(self._send(job), resend())

    async def _send(self, job: Job) -> None:
        tally, client = self.tallies[job.client], self.clients[job.client]
        extra: dict[str, Any] = {"priority": job.priority} if self.send_priority else {}
        while True:
            try:
                async with self._in_flight[job.client]:
                    answer = await client.completions(model=self.model, prompt=job.prompt,
                                                      max_tokens=job.max_tokens,
                                                      ignore_eos=True, **extra)
            except CircuitOpenError as exc:
                tally.refused += 1
                await asyncio.sleep(max(0.2, exc.retry_after_s))
                continue
            except (KVScopeClientError, httpx.HTTPError) as exc:
                tally.failed += 1
                if len(tally.errors) < 3:
                    tally.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            tally.ok += 1
            tally.completion_tokens += int((answer.get("usage") or {})
                                           .get("completion_tokens", 0))
            return


def _http(app: str) -> httpx.AsyncClient:
    """An httpx client that sends ``<app> kvscope-client/<version>`` as its User-Agent.

    The SDK sets its own User-Agent on every call and has no option for the
    application's; an httpx request hook puts the application's token in front.
    """
    agent = f"{app} {USER_AGENT}"

    async def tag(request: httpx.Request) -> None:
        request.headers["User-Agent"] = agent

    # One connection per call, as the load generator (kvscope.http): a call written to a
    # kept-alive connection as vLLM closes it is lost as a ReadError the SDK (rightly) does
    # not retry, and retiring idle connections early still races in a starved process (CI:
    # the demo against a real vLLM, 1 of 40 lost).
    return httpx.AsyncClient(timeout=600.0, trust_env=False, event_hooks={"request": [tag]},
                             limits=http_limits(IN_FLIGHT, reuse=False))
