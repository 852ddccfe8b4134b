"""A fleet's series from one real sidecar's scrape: every engine series repeated for N
engines (server, engine, model, instance rewritten), the sidecar's own series once per
server, values varied per engine and over time around the scraped values.

Used by fleet_prometheus.py: ``openmetrics_chunks`` writes backfill input for promtool,
``Fleet.expositions`` live scrapes of the same fleet.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

MODELS = ("llama-3-8b", "llama-3-70b", "qwen2-7b", "mistral-7b")
BLOCK_SHARE = {"vllm_scheduler_free_blocks": 1.0, "vllm_scheduler_used_blocks": -1.0}
"""Pool gauges that move with the engine's free fraction (used = total - free)."""
ONE_HOT = {"kvscope_probe_state"}
FIXED = {"kvscope_engine_info", "vllm_scheduler_total_blocks", "kvscope_probe_ring_limit_bytes",
         "kvscope_receiver_queue_limit_bytes", "kvscope_probe_connected", "kvscope_ledger_synced",
         "kvscope_sink_connected"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float
    counter: bool


def read_exposition(text: str) -> list[Sample]:
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out.append(Sample(s.name, dict(s.labels), float(s.value), fam.type == "counter"))
    return out


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(d.items())) + "}"


class Fleet:
    """``engines`` engines, ``per_server`` to a vLLM server (and its sidecar)."""

    def __init__(self, samples: list[Sample], engines: int, origin: float,
                 per_server: int = 2, seed: int = 27) -> None:
        self.origin = origin
        """Where counters start (the first sample's time): they grow from there."""
        self.engine_t = [s for s in samples if "engine" in s.labels]
        self.sidecar_t = [s for s in samples if "engine" not in s.labels]
        self.engines, self.per_server = engines, per_server
        self.servers = math.ceil(engines / per_server)
        rng = np.random.default_rng(seed)
        self.load = rng.uniform(0.2, 1.0, engines)
        """Each engine's traffic, scaling its counters' rates."""
        self.phase = rng.uniform(0, 2 * math.pi, engines)
        self.never_fits = rng.uniform(0, 1, engines) < 0.01
        self.silent = rng.uniform(0, 1, engines) < 0.02
        self.series: list[tuple[str, int, Sample]] = []
        """(name{labels} text, engine index or -1, template) of every fleet series."""
        for i in range(engines):
            srv = i // per_server
            ident = {"job": "kvscope", "instance": f"sidecar-{srv:04d}:9477",
                     "server": f"gpu-{srv:04d}:8000", "engine": str(i % per_server),
                     "model": MODELS[srv % len(MODELS)]}
            for s in self.engine_t:
                self.series.append((s.name + _labels({**s.labels, **ident}), i, s))
        for srv in range(self.servers):
            ident = {"job": "kvscope", "instance": f"sidecar-{srv:04d}:9477"}
            for s in self.sidecar_t:
                self.series.append((s.name + _labels({**s.labels, **ident}), -1, s))

    def free_fraction(self, i: int, t: np.ndarray) -> np.ndarray:
        """A day-shaped free fraction: low at the engine's busy hour, from 0 to 0.9."""
        day = np.sin(2 * math.pi * t / 86400 + self.phase[i])
        return np.clip(0.45 + 0.5 * day * self.load[i], 0.0, 0.9)

    def values(self, idx: int, s: Sample, t: np.ndarray) -> np.ndarray:
        """One series' values at unix times ``t`` (counters grow from the scraped value)."""
        load = self.load[idx] if idx >= 0 else 0.6
        if s.counter:
            rate = max(s.value, 1.0) / 600.0 * load  # the twin run lasted minutes
            since = t - self.origin
            if s.value:
                return np.floor(s.value + rate * since)
            # a family at 0 in the run (a rare reason, say): one engine in 7 sees some
            return np.zeros_like(t) if idx % 7 else np.floor(0.01 * load * since)
        if idx < 0 or s.name in FIXED:
            return np.full_like(t, s.value)
        if s.name == "kvscope_probe_state":
            on = "silent" if self.silent[idx] else "active"
            return np.full_like(t, float(s.labels.get("state") == on))
        if s.name == "vllm_scheduler_waiting_head_never_fits":
            return np.full_like(t, float(self.never_fits[idx]))
        free = self.free_fraction(idx, t)
        total = next((x.value for x in self.engine_t
                      if x.name == "vllm_scheduler_total_blocks"), 1.0)
        if s.name in BLOCK_SHARE:
            f = free if BLOCK_SHARE[s.name] > 0 else 1 - free
            return np.round(f * total)
        if s.name == "vllm_scheduler_kv_block_usage_ratio":
            return 1 - free
        if s.name.endswith("_ratio"):
            return np.clip(s.value * (0.8 + 0.2 * np.cos(t / 3600 + self.phase[idx])), 0, 1)
        return np.round(s.value * (0.7 + 0.3 * (1 - free)), 3)

    def expositions(self, t0: float, t1: float, step: float) -> list[bytes]:
        """Scrapes of the whole fleet every ``step`` from ``t0`` (no timestamps), rendered
        ahead: rendering one takes longer than a scrape may."""
        t = np.arange(t0, t1, step)
        cols = [(text, self.values(i, s, t).tolist()) for text, i, s in self.series]
        return ["".join(f"{text} {v[k]:.12g}\n" for text, v in cols).encode()
                for k in range(len(t))]


def openmetrics_chunks(fleet: Fleet, start: float, end: float, step: float, out: Path,
                       chunk_s: float = 7200.0) -> Iterator[tuple[Path, int]]:
    """OpenMetrics files of consecutive ``chunk_s`` windows (promtool's block size), each
    written, yielded (with its sample count) and expected to be deleted by the caller."""
    t0 = start
    while t0 < end:
        t = np.arange(t0, min(t0 + chunk_s, end), step)
        stamps = [f"{x:.0f}" for x in t]
        path = out / f"chunk-{int(t0)}.om"
        n = 0
        with path.open("w") as f:
            for text, i, s in fleet.series:
                vals = fleet.values(i, s, t).tolist()
                f.write("".join(f"{text} {v:.12g} {ts}\n"
                                for v, ts in zip(vals, stamps, strict=True)))
                n += len(vals)
            f.write("# EOF\n")
        yield path, n
        t0 += chunk_s
