"""Assembles the sidecar from a ServeConfig and runs it."""

from __future__ import annotations

import logging
import threading

import uvicorn
from prometheus_client import CollectorRegistry

from kvscope.config import ServeConfig
from kvscope.sidecar.app import create_app
from kvscope.sidecar.clients import ClientJoin
from kvscope.sidecar.gpu import GpuReader
from kvscope.sidecar.hub import Hub
from kvscope.sidecar.metrics import KVScopeCollector
from kvscope.sidecar.process import ProcessReader
from kvscope.sidecar.receiver import Receiver
from kvscope.sidecar.requests import RequestTracker
from kvscope.sidecar.vllm_metrics import VllmScraper
from kvscope.sinks.base import SinkManager
from kvscope.sinks.decisionlog import DecisionLog
from kvscope.sinks.rows import RequestTrace

log = logging.getLogger("kvscope.sidecar")


class Sidecar:
    """Receiver thread + optional vLLM scraper + HTTP server, sharing one Hub."""

    def __init__(self, cfg: ServeConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.hub = Hub()
        self.sinks = SinkManager()
        if cfg.decision_log != "off":
            path = None if cfg.decision_log == "-" else cfg.decision_log
            self.sinks.add(DecisionLog(path, max_bytes=cfg.decision_log_max_bytes))
        self.clients = ClientJoin(self.sinks.emit)
        self.tracker = RequestTracker(self._route)
        self.hub.listeners.append(self.tracker.on_event)
        self.hub.client_listeners.append(self.clients.on_client)
        self.hub.tick_listeners.append(self.clients.tick)
        self.receiver = Receiver(self.hub, list(cfg.endpoints))
        self.scraper = (
            VllmScraper(cfg.vllm_url, cfg.vllm_scrape_interval_s) if cfg.vllm_url else None
        )
        self.registry = CollectorRegistry()
        self.registry.register(
            KVScopeCollector(
                self.hub,
                health_timeout_s=cfg.health_timeout_s,
                gpu=GpuReader(),
                processes=ProcessReader(),
                vllm=self.scraper,
                clients=self.clients.stats,
            )
        )
        self.app = create_app(
            self.hub,
            self.registry,
            health_timeout_s=cfg.health_timeout_s,
            token=cfg.token,
            receiver_error=lambda: self.receiver.error,
        )
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host=cfg.host,
                port=cfg.port,
                log_level=cfg.log_level.lower(),
                access_log=False,
                limit_concurrency=256,
                timeout_graceful_shutdown=5,
            )
        )
        self._thread: threading.Thread | None = None

    def _route(self, row: object) -> None:
        """Traces wait for their client event; every other row goes straight out."""
        if isinstance(row, RequestTrace):
            self.clients.on_trace(row)
        else:
            self.sinks.emit(row)

    def start_background(self) -> None:
        """Bind and start everything; the HTTP server runs on its own thread."""
        self.receiver.bind()
        self.receiver.start()
        if self.scraper:
            self.scraper.start()
        self._thread = threading.Thread(target=self.server.run, name="kvscope-http", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Bind and serve until SIGINT / SIGTERM (uvicorn handles both)."""
        self.receiver.bind()
        self.receiver.start()
        if self.scraper:
            self.scraper.start()
        log.info("kvscope sidecar on http://%s:%d/metrics", self.cfg.host, self.cfg.port)
        try:
            self.server.run()
        finally:
            self.stop()

    def stop(self) -> None:
        self.server.should_exit = True
        if self.scraper:
            self.scraper.stop_event.set()
        self.receiver.stop()
        with self.hub.lock:
            self.tracker.flush(self.hub.engines)
            self.clients.flush()
        self.sinks.close()
        if self._thread is not None:
            self._thread.join(10)
