"""A bounded, seeded mix of completions against an OpenAI-compatible server.

Mostly short prompts with some long ones, half of the long ones sharing a prefix (so the
prefix cache gets hits), and ``ignore_eos`` so ``max_tokens`` fixes each request's length.
Against the tiny model on a 48-block pool this is enough to fill the KV cache and cause
preemptions. Each request carries ``X-Request-Id: kvs-<seed>-<index>``, which vLLM turns
into the response id ``cmpl-kvs-<seed>-<index>``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from kvscope.http import describe
from kvscope.http import limits as http_limits

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
WORDS = tuple(f"w{i}" for i in range(900))
"""The tiny model's tokenizer knows these words: one token each."""
MAX_ERRORS_KEPT = 5


@dataclass(frozen=True)
class LoadSpec:
    """The request mix; the same spec always yields the same requests."""

    n_requests: int = 120
    concurrency: int = 32
    seed: int = 0
    short_fraction: float = 0.7
    short_words: tuple[int, int] = (8, 48)
    long_words: tuple[int, int] = (300, 700)
    shared_prefix_fraction: float = 0.5
    """Fraction of the LONG requests that start with the shared prefix."""
    shared_prefix_words: int = 256
    max_tokens: tuple[int, int] = (32, 256)
    priority: tuple[int, int] | None = None
    """Inclusive range for a random per-request ``priority`` (vLLM: lower runs first)."""
    model: str = "tiny"
    timeout_s: float = 600.0
    """Deadline for the whole load; requests still running then count as errors."""
    headers: dict[str, str] = field(default_factory=dict, hash=False)
    """Sent with every request; may override X-Request-Id."""

    def __post_init__(self) -> None:
        errors = []
        if self.n_requests < 0:
            errors.append(f"n_requests must be >= 0, got {self.n_requests}")
        if self.concurrency < 1:
            errors.append(f"concurrency must be >= 1, got {self.concurrency}")
        for name in ("short_fraction", "shared_prefix_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                errors.append(f"{name} must be in [0, 1], got {getattr(self, name)}")
        # Priorities may be negative in vLLM; word and token counts may not.
        for name, floor in (("short_words", 0), ("long_words", 0), ("max_tokens", 1),
                            ("priority", None)):
            bounds = getattr(self, name)
            if bounds is None:
                continue
            if bounds[0] > bounds[1] or (floor is not None and bounds[0] < floor):
                errors.append(f"{name} must be (low, high) with low <= high"
                              f"{'' if floor is None else f' and low >= {floor}'}, got {bounds}")
        if self.timeout_s <= 0:
            errors.append(f"timeout_s must be positive, got {self.timeout_s}")
        if errors:
            raise ValueError("invalid LoadSpec: " + "; ".join(errors))


@dataclass(frozen=True)
class RequestOutcome:
    index: int
    ok: bool
    status: int | None
    """HTTP status, or None when no response arrived."""
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    request_id: str | None
    """The response's ``id`` (``cmpl-<X-Request-Id>``)."""
    error: str | None = None


@dataclass(frozen=True)
class LoadResult:
    requests: int
    ok: int
    errors: list[str]
    """The first few error messages (at most MAX_ERRORS_KEPT)."""
    error_count: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    latency_p50_s: float
    """Latency percentiles are over successful requests; 0.0 when none succeeded."""
    latency_p99_s: float
    latency_max_s: float
    completion_tokens_per_s: float
    outcomes: list[RequestOutcome]

    def summary(self) -> dict[str, Any]:
        """Everything but the per-request outcomes, for printing or JSON."""
        data = asdict(self)
        del data["outcomes"]
        return data


def build_requests(spec: LoadSpec) -> list[dict[str, Any]]:
    """The JSON bodies for /v1/completions, in request-index order."""
    # The draw order matches vllm-prototypes/load.py, so seed 0 reproduces its mix.
    rng = random.Random(spec.seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(spec.shared_prefix_words))
    bodies = []
    for _ in range(spec.n_requests):
        if rng.random() < spec.short_fraction:
            prompt = _words(rng, rng.randint(*spec.short_words))
        else:
            prompt = _words(rng, rng.randint(*spec.long_words))
            if rng.random() < spec.shared_prefix_fraction:
                prompt = f"{shared} {prompt}"
        body: dict[str, Any] = {
            "model": spec.model, "prompt": prompt, "max_tokens": rng.randint(*spec.max_tokens),
            "ignore_eos": True, "temperature": 0.8,
        }
        if spec.priority is not None:
            body["priority"] = rng.randint(*spec.priority)
        bodies.append(body)
    return bodies


def request_headers(spec: LoadSpec, index: int) -> httpx.Headers:
    headers = httpx.Headers({"X-Request-Id": f"kvs-{spec.seed}-{index}"})
    headers.update(spec.headers)  # case-insensitive: an override replaces the default
    return headers


async def run_load(base_url: str = DEFAULT_BASE_URL, spec: LoadSpec | None = None,
                   on_done: Callable[[RequestOutcome], None] | None = None) -> LoadResult:
    """Send exactly ``spec.n_requests`` completions, at most ``spec.concurrency`` at once.

    ``on_done`` is called once per request as it finishes (or is cut off by the deadline).
    """
    spec = spec or LoadSpec()
    bodies = build_requests(spec)
    outcomes: dict[int, RequestOutcome] = {}
    semaphore = asyncio.Semaphore(spec.concurrency)

    def record(outcome: RequestOutcome) -> None:
        outcomes[outcome.index] = outcome
        if on_done is not None:
            on_done(outcome)

    async def one(client: httpx.AsyncClient, index: int) -> None:
        async with semaphore:
            record(await _post(client, index, bodies[index], request_headers(spec, index)))

    # trust_env=False: an HTTP(S)_PROXY in the environment must not capture 127.0.0.1.
    # reuse=False: a request sent on a connection vLLM is closing is lost (kvscope.http).
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(spec.timeout_s), trust_env=False,
        limits=http_limits(spec.concurrency, reuse=False),
    ) as client:
        started = time.perf_counter()
        tasks = [asyncio.create_task(one(client, i)) for i in range(spec.n_requests)]
        pending: set[asyncio.Task[None]] = set()
        if tasks:  # asyncio.wait rejects an empty set
            _done, pending = await asyncio.wait(tasks, timeout=spec.timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - started
    for index in range(spec.n_requests):
        if index not in outcomes:
            record(RequestOutcome(index, False, None, elapsed, 0, 0, None,
                                  error=f"cut off by the {spec.timeout_s:g} s load deadline"))
    return _summarise([outcomes[i] for i in range(spec.n_requests)], elapsed)


def run_load_sync(base_url: str = DEFAULT_BASE_URL, spec: LoadSpec | None = None,
                  on_done: Callable[[RequestOutcome], None] | None = None) -> LoadResult:
    return asyncio.run(run_load(base_url, spec, on_done))


async def _post(client: httpx.AsyncClient, index: int, body: dict[str, Any],
                headers: httpx.Headers) -> RequestOutcome:
    started = time.perf_counter()
    try:
        response = await client.post("/v1/completions", json=body, headers=headers)
    except httpx.HTTPError as exc:
        return RequestOutcome(index, False, None, time.perf_counter() - started, 0, 0, None,
                              error=describe(exc)[:200])
    latency = time.perf_counter() - started
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if response.status_code != 200 or not isinstance(payload, dict):
        return RequestOutcome(index, False, response.status_code, latency, 0, 0, None,
                              error=f"HTTP {response.status_code}: {response.text[:200]}")
    usage = payload.get("usage") or {}
    return RequestOutcome(index, True, response.status_code, latency,
                          int(usage.get("prompt_tokens", 0)),
                          int(usage.get("completion_tokens", 0)), payload.get("id"))


def _summarise(outcomes: list[RequestOutcome], elapsed: float) -> LoadResult:
    good = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    latencies = sorted(o.latency_s for o in good)
    completion_tokens = sum(o.completion_tokens for o in good)
    return LoadResult(
        requests=len(outcomes), ok=len(good),
        errors=[o.error or "unknown error" for o in failed[:MAX_ERRORS_KEPT]],
        error_count=len(failed),
        prompt_tokens=sum(o.prompt_tokens for o in good),
        completion_tokens=completion_tokens,
        elapsed_s=elapsed,
        latency_p50_s=_percentile(latencies, 0.50),
        latency_p99_s=_percentile(latencies, 0.99),
        latency_max_s=latencies[-1] if latencies else 0.0,
        completion_tokens_per_s=completion_tokens / elapsed if elapsed > 0 else 0.0,
        outcomes=outcomes,
    )


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(math.ceil(q * len(ordered)) - 1, 0))]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))
