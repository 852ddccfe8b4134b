"""Seeded synthetic workloads: a mix of short and long prompts arriving in waves.

The default mix is the one that makes a 48-block pool preempt: 70% short prompts,
30% long ones, half of the long ones sharing a 256-token prefix (prefix-cache hits).
Random draws happen in the same order as the load generator used against real
servers, so a seed names the same mix in both places.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOKEN_ID_MIN = 4
"""Lowest token id used: ids 0..3 are the tiny model's special tokens."""

TOKEN_ID_MAX = 900
"""One past the highest token id used (ids 4..903 are the words ``w0`` .. ``w899``)."""


@dataclass(frozen=True)
class TwinRequest:
    """One request as the twin submits it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    """Output tokens wanted; EOS is ignored, so this is the output length unless the
    request reaches ``max_model_len`` first."""
    priority: int
    """Lower is served first under the priority policy (vLLM's convention)."""
    arrival_step: int
    """Scheduler step at which the request is added."""


@dataclass(frozen=True)
class WorkloadSpec:
    """What ``generate`` draws; every range is inclusive at both ends."""

    n_requests: int = 120
    short_fraction: float = 0.7
    """Share of requests with a short prompt."""
    short_prompt: tuple[int, int] = (8, 48)
    """Prompt length range of short requests, in tokens."""
    long_prompt: tuple[int, int] = (300, 700)
    """Length range of a long request's own prompt, before any shared prefix."""
    shared_prefix_fraction: float = 0.5
    """Share of long requests whose prompt starts with the shared prefix."""
    shared_prefix_len: int = 256
    """Tokens in the shared prefix, which is prepended to the long prompt's own tokens."""
    max_tokens: tuple[int, int] = (32, 256)
    waves: int = 4
    """Requests are split into this many equal groups that arrive together."""
    wave_interval_steps: int = 20
    """Scheduler steps between one wave and the next."""
    priorities: tuple[int, int] = (0, 3)
    seed: int = 0

    def validate(self) -> list[str]:
        """Every problem with this spec, one sentence each; empty when it is usable."""
        errors: list[str] = []
        if self.n_requests < 0:
            errors.append(f"n_requests must not be negative, got {self.n_requests}.")
        for name in ("short_fraction", "shared_prefix_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                errors.append(f"{name} must be between 0 and 1, got {value}.")
        for name, least in (("short_prompt", 1), ("long_prompt", 1), ("max_tokens", 1)):
            low, high = getattr(self, name)
            if not least <= low <= high:
                errors.append(f"{name} must be a range ({least} <= low <= high), got {low, high}.")
        low, high = self.priorities
        if low > high:
            errors.append(f"priorities must be a range (low <= high), got {low, high}.")
        if self.shared_prefix_len < 0:
            errors.append(f"shared_prefix_len must not be negative, got {self.shared_prefix_len}.")
        if self.waves < 1:
            errors.append(f"waves must be at least 1, got {self.waves}.")
        if self.wave_interval_steps < 0:
            errors.append(
                f"wave_interval_steps must not be negative, got {self.wave_interval_steps}."
            )
        return errors


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_ID_MIN, TOKEN_ID_MAX) for _ in range(n)]


def generate(spec: WorkloadSpec) -> list[TwinRequest]:
    """The requests ``spec`` describes, in arrival order; the same spec gives the same list."""
    errors = spec.validate()
    if errors:
        raise ValueError("invalid WorkloadSpec: " + " ".join(errors))
    rng = random.Random(spec.seed)
    shared = _tokens(rng, spec.shared_prefix_len)
    requests = []
    for i in range(spec.n_requests):
        if rng.random() < spec.short_fraction:
            prompt = _tokens(rng, rng.randint(*spec.short_prompt))
        else:
            prompt = _tokens(rng, rng.randint(*spec.long_prompt))
            if rng.random() < spec.shared_prefix_fraction:
                prompt = shared + prompt
        wave = i * spec.waves // spec.n_requests
        requests.append(
            TwinRequest(
                request_id=f"r{i}",
                prompt_token_ids=tuple(prompt),
                max_tokens=rng.randint(*spec.max_tokens),
                priority=rng.randint(*spec.priorities),
                arrival_step=wave * spec.wave_interval_steps,
            )
        )
    return requests
