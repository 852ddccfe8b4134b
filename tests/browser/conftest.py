"""Browser tests: the /ui page in headless Chromium (Debian's ``chromium``) via Playwright.

The sidecar is real (create_app + layout_router on uvicorn, 127.0.0.1, a free port) and is
fed by the twin: vLLM's real scheduler with the probe bound, run for a fixed number of
steps and then left paused, so the pool stays busy and the layout stays still while the
page is inspected. Needs ``apt-get install chromium`` and ``pip install playwright``
(never ``playwright install``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvscope.layout.api import layout_router
from kvscope.layout.sampler import LayoutSampler
from kvscope.localvllm.server import free_port
from kvscope.sidecar.http.app import create_app
from kvscope.state.hub import Hub

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
TWIN_STEPS = 300
SAMPLE_EVERY = 5  # twin steps per (synthetic) second of sampling


@dataclass
class Fed:
    """A Hub and LayoutSampler holding a paused twin run."""

    hub: Hub
    sampler: LayoutSampler


@pytest.fixture(scope="session")
def fed() -> Fed:
    """Run the twin 300 steps (64 blocks, fcfs) with the probe bound, then stop mid-run."""
    from kvscope.twin import TwinConfig, WorkloadSpec, generate
    from kvscope.twin.probed import ProbedTwin

    pt = ProbedTwin(TwinConfig(num_blocks=64), seed=1)
    hub, rec = pt.hub, pt.rec
    sampler = LayoutSampler(hub)
    t0 = time.time() - TWIN_STEPS / SAMPLE_EVERY - 1

    def on_step(i: int, out: object) -> None:
        if i % SAMPLE_EVERY == 0:
            sampler.tick(now=t0 + i / SAMPLE_EVERY)

    pt.run(generate(WorkloadSpec(n_requests=120, seed=1)), on_step=on_step,
           max_steps=TWIN_STEPS)
    sampler.tick(now=time.time())
    st = hub.engines[rec.hello.engine]
    assert st.ledger.synced and sum(st.counters.preemptions.values()) > 0
    return Fed(hub, sampler)


@dataclass
class Served:
    url: str
    hub: Hub


def build_app(f: Fed, token: str | None) -> FastAPI:
    app = create_app(f.hub, CollectorRegistry(), health_timeout_s=3600, token=token)
    app.include_router(layout_router(f.hub, f.sampler))
    return app


@pytest.fixture(scope="module")
def serve(fed: Fed) -> Iterator[Callable[[str | None], Served]]:
    """Start a sidecar app (optionally with a bearer token) on a thread; all stop at the end."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(token: str | None = None) -> Served:
        # A live sidecar samples its (here idle) engine every second: without this the
        # session's sample was as old as the fixture, and the page said "sample 16 s ago"
        # instead of "live" when this module ran later on its xdist worker.
        fed.sampler.tick()
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(build_app(fed, token), host="127.0.0.1",
                                               port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, name=f"ui-test-{port}", daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
            time.sleep(0.02)
        servers.append((server, thread))
        return Served(f"http://127.0.0.1:{port}", fed.hub)

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Module scope: Playwright's sync API holds an asyncio loop on the main thread while it
    runs, which would break later tests that call ``asyncio.run``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser: Any) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, device_scale_factor=1)
    pg = ctx.new_page()
    yield pg
    ctx.close()
