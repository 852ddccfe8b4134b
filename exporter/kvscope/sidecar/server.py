"""Assembles the sidecar from a ServeConfig and runs it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry

from kvscope.decisions.log import DecisionLog
from kvscope.decisions.loki import LokiSink
from kvscope.explain.api import explain_router
from kvscope.layout.api import layout_router
from kvscope.layout.history import clickhouse_history, layout_rows, to_row
from kvscope.layout.sampler import LayoutSampler
from kvscope.layout.store_cadence import StoreCadence
from kvscope.os_thread import name_os_thread
from kvscope.rows import RequestTrace
from kvscope.sidecar import cyclic_gc
from kvscope.sidecar.config import ServeConfig
from kvscope.sidecar.exposition.gpu import GpuReader
from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.sidecar.exposition.own_cpu import OwnCpu
from kvscope.sidecar.exposition.process import ProcessReader
from kvscope.sidecar.exposition.vllm_metrics import VllmScraper
from kvscope.sidecar.http.app import create_app
from kvscope.sidecar.http.connections import MAX_IN_FLIGHT, RequestBoundProtocol
from kvscope.sidecar.ingest.receiver import Receiver
from kvscope.sinks.base import SinkManager
from kvscope.sinks.metrics import SinkCollector
from kvscope.sinks.options import DeliveryOptions
from kvscope.state.clients import ClientJoin
from kvscope.state.hashkey import Keyer, load_or_create
from kvscope.state.hub import Hub
from kvscope.state.requests import RequestTracker
from kvscope.store.sink import ClickHouseSink

log = logging.getLogger("kvscope.sidecar")


def explain_reader(hub: Hub, tracker: RequestTracker, store: ClickHouseSink
                   ) -> Callable[[], Any]:
    """The explain API's store client, opened once the rows so far are delivered: the
    allocations the tracker still keeps (up to ``FLUSH_EVERY_S`` of engine time) written
    first, under the hub's lock (the receiver thread's steps add to them), or a request
    that only grew since would be no holder of the pool at a preemption a moment ago."""
    def connect() -> Any:
        with hub.lock:
            tracker.flush_allocations()
        return store.fresh_reader()

    return connect


class Sidecar:
    """Receiver thread + optional vLLM scraper + HTTP server, sharing one Hub."""

    def __init__(self, cfg: ServeConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        keyer = Keyer(load_or_create(cfg.hash_key_file, cfg.data_dir))  # never logged
        self.hub = Hub(health_timeout_s=cfg.health_timeout_s)
        self.sinks, store = open_sinks(cfg)
        self.clients = ClientJoin(self.sinks.emit, keyer=keyer, horizon=self.hub.record_horizon)
        self.tracker = RequestTracker(self._route, wants=self.sinks.wants)
        self.hub.listeners.append(self.tracker.on_event)
        self.hub.client_listeners.append(self.clients.on_client)
        self.hub.tick_listeners.append(self.clients.tick)
        self.receiver = Receiver(self.hub, list(cfg.endpoints), secret=cfg.secret(),
                                 buffer_bytes=cfg.receive_buffer_bytes)
        self.scraper = (
            VllmScraper(cfg.vllm_url, cfg.vllm_scrape_interval_s) if cfg.vllm_url else None
        )
        self.registry = CollectorRegistry()
        self.registry.register(
            KVScopeCollector(
                self.hub,
                gpu=GpuReader(),
                processes=ProcessReader(),
                vllm=self.scraper,
                clients=self.clients.stats,
                receiver=self.receiver,
                own=OwnCpu(),
            )
        )
        self.registry.register(SinkCollector(self.sinks))
        self.app = create_app(
            self.hub,
            self.registry,
            token=cfg.token,
            receiver_alive=lambda: self.receiver.alive(),
        )
        self.layout = LayoutSampler(self.hub, interval_s=cfg.layout_interval_s,
                                    history_bytes=cfg.layout_history_bytes)
        self.layout.subscribe(self._layout_rows)
        self.layout_cadence = StoreCadence(cfg.layout_store_interval_s)
        history = clickhouse_history(store.fresh_client, store.database) if store else None
        self.app.include_router(layout_router(self.hub, self.layout, history))
        self.app.include_router(explain_router(
            explain_reader(self.hub, self.tracker, store) if store else None))
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so nothing after
        # server.run() is guaranteed to run: flush from the app's shutdown instead.
        self.app.router.on_shutdown.append(self.stop_workers)
        self._stopped = False
        self.server = uvicorn.Server(_uvicorn_config(cfg, self.app))
        self._thread: threading.Thread | None = None

    def _layout_rows(self, snap: Any) -> None:
        # A snapshot's row is three lists of one entry per block: built only for a store.
        if self.sinks.wants("layout_snapshots"):
            for kept in self.layout_cadence.pick(snap):
                for r in layout_rows(kept, arrays=True):
                    self.sinks.emit(to_row(r))

    def _route(self, row: object) -> None:
        """Traces wait for their client event; every other row goes straight out."""
        if isinstance(row, RequestTrace):
            self.clients.on_trace(row)
        else:
            self.sinks.emit(row)

    def _start_workers(self) -> None:
        self.receiver.bind()
        self.receiver.start()
        self.layout.start()
        if self.scraper:
            self.scraper.start()

    def start_background(self) -> None:
        """Bind and start everything; the HTTP server runs on its own thread."""
        self._start_workers()
        self._thread = threading.Thread(target=self._serve_http, name="kvscope-http",
                                        daemon=True)
        self._thread.start()

    def _serve_http(self) -> None:
        name_os_thread()
        self.server.run()

    def run(self) -> None:
        """Bind and serve until SIGINT / SIGTERM (uvicorn handles both)."""
        # What start-up built leaves the cyclic collector's view, and a frame's burst of
        # lists no longer sets it off (kvscope.sidecar.cyclic_gc).
        cyclic_gc.tune()
        self._start_workers()
        log.info("kvscope sidecar on %s://%s:%d/metrics", "https" if self.cfg.tls_cert else "http",
                 self.cfg.host, self.cfg.port)
        try:
            self.server.run()
        finally:
            self.stop()

    def stop(self) -> None:
        self.server.should_exit = True
        self.stop_workers()
        if self._thread is not None:
            self._thread.join(10)

    def stop_workers(self) -> None:
        """Stop receiving, write out every row (or spool it), close the stores. Once."""
        if self._stopped:
            return
        self._stopped = True
        if self.scraper:
            self.scraper.stop_event.set()
        self.receiver.stop()
        self.layout.stop()
        with self.hub.lock:
            self.tracker.flush(self.hub.engines)
            self.clients.flush()
        self.sinks.close()
        log.info("kvscope sidecar stopped")


def open_sinks(cfg: ServeConfig) -> tuple[SinkManager, ClickHouseSink | None]:
    """Every sink ``cfg`` asks for (decision log, Loki, ClickHouse), the store apart too."""
    sinks = SinkManager()
    if cfg.decision_log != "off":
        path = None if cfg.decision_log == "-" else cfg.decision_log
        sinks.add(DecisionLog(path, max_bytes=cfg.decision_log_max_bytes))
    if cfg.loki_url:
        sinks.add(LokiSink(cfg.loki_url, f"{cfg.data_dir}/spool-loki", tenant=cfg.loki_tenant))
    dsn = cfg.store_dsn()
    if dsn is None:
        return sinks, None
    store = ClickHouseSink(
        dsn, ttl_days=cfg.clickhouse_ttl_days, spool_dir=f"{cfg.data_dir}/spool",
        options=DeliveryOptions(batch_interval_s=cfg.clickhouse_batch_interval_s,
                                insert_interval_s=cfg.store_insert_interval_s()))
    if dsn.startswith("chdb://"):
        # An embedded store that cannot open (another process holds the directory) is a
        # configuration error: say so now instead of spooling forever.
        try:
            store.client()
        except Exception as exc:
            store.close(1.0)
            raise RuntimeError(
                f"cannot open the embedded ClickHouse store in {cfg.data_dir} "
                f"({type(exc).__name__}); is another kvscope using it? "
                "Use --data-dir or --clickhouse-dsn") from None
    sinks.add(store)
    return sinks, store


def _uvicorn_config(cfg: ServeConfig, app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level.lower(),
        access_log=False,
        http=RequestBoundProtocol,  # requests in flight bounded, not open connections
        limit_concurrency=MAX_IN_FLIGHT,
        timeout_graceful_shutdown=5,
        ssl_certfile=cfg.tls_cert,
        ssl_keyfile=cfg.tls_key,
    )
