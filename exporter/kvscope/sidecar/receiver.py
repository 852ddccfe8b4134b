"""ZMQ PULL socket bound where probes connect; feeds every message to the Hub."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import zmq

from kvscope.sidecar.hub import Hub

log = logging.getLogger("kvscope.sidecar")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a keyframe of a 1M-block pool fits


def prepare_endpoint(endpoint: str) -> None:
    """Create the directory of an ipc:// endpoint, private to this user."""
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)


class Receiver(threading.Thread):
    def __init__(self, hub: Hub, endpoints: list[str], *, rcvhwm: int = 10000) -> None:
        super().__init__(name="kvscope-receiver", daemon=True)
        self.hub = hub
        self.endpoints = endpoints
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)

    def bind(self) -> None:
        """Bind every endpoint now, so a bad endpoint fails at start, loudly."""
        for ep in self.endpoints:
            prepare_endpoint(ep)
            self._sock.bind(ep)
            if ep.startswith("ipc://"):
                os.chmod(ep[len("ipc://"):], 0o600)
        log.info("receiving probe records on %s", ", ".join(self.endpoints))

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        self.ready.set()
        try:
            next_tick = time.monotonic()
            while not self.stop_event.is_set():
                if time.monotonic() >= next_tick:
                    self.hub.tick()
                    next_tick = time.monotonic() + 0.1
                if not poller.poll(100):
                    continue
                for _ in range(1000):
                    try:
                        parts = self._sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.hub.accept(parts)
        except Exception as exc:  # noqa: BLE001 - surfaced through /healthz
            self.error = exc
            log.exception("receiver stopped")
        finally:
            self._sock.close(0)
            self._ctx.term()

    def stop(self, timeout_s: float = 2.0) -> None:
        self.stop_event.set()
        self.join(timeout_s)
