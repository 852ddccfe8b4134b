"""A sidecar app serving ``/api/requests`` and ``/ui/requests`` from a chDB store that a twin
run (the probe, the RequestTracker, the LayoutSampler every 3 steps) has just filled.

Runs as its own process (``python -m tests.browser.request_store DIR PORT``): chDB opens
one data directory per process and other suites open theirs. Prints one JSON line (the
port and two request IDs: the most preempted and one never preempted) once it serves,
then serves until killed.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any


def fill(data_dir: str) -> dict[str, Any]:
    from kvscope.layout.history import layout_rows, to_row
    from kvscope.layout.sampler import LayoutSampler
    from kvscope.rows import RequestTrace
    from kvscope.sinks.base import SinkManager
    from kvscope.state.requests import RequestTracker
    from kvscope.store.sink import ClickHouseSink
    from kvscope.twin import TwinConfig, WorkloadSpec, generate
    from kvscope.twin.probed import ProbedTwin
    from tests.clickhouse.conftest import FAST

    sink = ClickHouseSink(f"chdb://{data_dir}/store", options=FAST, spool_dir=f"{data_dir}/spool")
    sinks = SinkManager([sink])
    rows: list[Any] = []
    pt = ProbedTwin(TwinConfig(num_blocks=48), seed=5)
    pt.hub.listeners.append(RequestTracker(lambda r: (rows.append(r), sinks.emit(r))).on_event)
    sampler = LayoutSampler(pt.hub, interval_s=0.001)  # every call samples
    t0 = time.time()
    sampler.subscribe(lambda snap: [sinks.emit(to_row(r)) for r in layout_rows(snap)])
    pt.run(generate(WorkloadSpec(n_requests=40, seed=5)),
           on_step=lambda i, _o: sampler.tick(now=t0 + i / 100) if i % 3 == 0 else None)
    assert sink.flush(60)
    traces = [r for r in rows if isinstance(r, RequestTrace)]
    worst = max(traces, key=lambda t: (t.preempt_count, t.request_id))
    calm = next(t for t in traces if t.preempt_count == 0)
    return {"sink": sink, "preempted": worst.request_id, "preempt_count": worst.preempt_count,
            "calm": calm.request_id}


def main(data_dir: str, port: int) -> None:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from kvscope.explain.api import explain_router
    from kvscope.sidecar.http.app import create_app
    from kvscope.state.hub import Hub

    got = fill(data_dir)
    app = create_app(Hub(), CollectorRegistry(), token="t0ken")
    app.include_router(explain_router(got.pop("sink").reader))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    # Listening before the line goes out: uvicorn runs the app's startup handlers before it
    # binds (uvicorn/server.py, Server.startup), so a line printed from one raced the bind
    # and the test's first request was refused (CI on 1d21888). Connections made before
    # uvicorn serves wait in this socket's backlog.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    print(json.dumps({"port": port, **got}), flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
