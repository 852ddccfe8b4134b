"""Reads vLLM's own /metrics: a coarse view where no probe runs, a cross-check where one does.

From vLLM's exposition kvscope can learn only usage, preemptions and queue lengths;
free blocks are derived as ``round((1 - kv_cache_usage_perc) * (num_gpu_blocks - 1))``
(block 0 is vLLM's null block, ``get_usage`` divides by ``num_gpu_blocks - 1``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscope.os_thread import name_os_thread
from kvscope.redact import safe_url
from kvscope.throttle import worth_logging

log = logging.getLogger("kvscope.sidecar")


@dataclass(frozen=True)
class VllmEngineMetrics:
    engine: str
    model: str
    usage: float | None
    preemptions: float | None
    running: float | None
    waiting: float | None
    num_gpu_blocks: int | None
    block_size: int | None

    @property
    def free_blocks(self) -> int | None:
        if self.usage is None or not self.num_gpu_blocks:
            return None
        return round((1.0 - self.usage) * (self.num_gpu_blocks - 1))



def parse(text: str) -> dict[str, VllmEngineMetrics]:
    """Per-engine figures from one vLLM exposition."""
    values: dict[str, dict[str, float]] = {}
    models: dict[str, str] = {}
    info: dict[str, tuple[int | None, int | None]] = {}
    wanted = {
        "vllm:kv_cache_usage_perc": "usage",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
    }
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            engine = s.labels.get("engine", "0")
            if s.name in wanted:
                values.setdefault(engine, {})[wanted[s.name]] = float(s.value)
                if "model_name" in s.labels:
                    models[engine] = s.labels["model_name"]
            elif s.name == "vllm:cache_config_info":
                info[engine] = (_int(s.labels.get("num_gpu_blocks")),
                                _int(s.labels.get("block_size")))
    out = {}
    for engine in set(values) | set(info):
        v = values.get(engine, {})
        blocks, bs = info.get(engine, (None, None))
        if blocks is None and len(info) == 1:  # cache_config_info may carry no engine label
            blocks, bs = next(iter(info.values()))
        out[engine] = VllmEngineMetrics(
            engine, models.get(engine, ""), v.get("usage"), v.get("preemptions"),
            v.get("running"), v.get("waiting"), blocks, bs,
        )
    return out


def _int(s: str | None) -> int | None:
    try:
        return int(s) if s not in (None, "", "None") else None
    except ValueError:
        return None


class VllmScraper(threading.Thread):
    """Polls ``<url>/metrics`` every ``interval_s``; keeps the last good parse."""

    def __init__(self, url: str, interval_s: float = 5.0, timeout_s: float = 3.0) -> None:
        super().__init__(name="kvscope-vllm-scraper", daemon=True)
        self.url = url.rstrip("/")
        self.safe_url = safe_url(self.url)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.latest: dict[str, VllmEngineMetrics] = {}
        self.last_ok_monotonic: float | None = None
        self.scrapes = 0
        self.errors = 0
        self.stop_event = threading.Event()

    def scrape_once(self, client: httpx.Client) -> None:
        try:
            resp = client.get(f"{self.url}/metrics")
            resp.raise_for_status()
            self.latest = parse(resp.text)
            self.last_ok_monotonic = time.monotonic()
            self.scrapes += 1
        except Exception as exc:  # noqa: BLE001 - never crash the sidecar over a scrape
            self.errors += 1
            if worth_logging(self.errors):
                log.warning("scrape of %s/metrics failed (%d so far): %s",
                            self.safe_url, self.errors, type(exc).__name__)

    def run(self) -> None:
        name_os_thread()
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self.stop_event.is_set():
                self.scrape_once(client)
                self.stop_event.wait(self.interval_s)
