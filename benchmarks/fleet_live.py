"""The remote-write pair of fleet_prometheus.py: one Prometheus scrapes the synthesized
fleet live with kvscope's rule file and remote-writes every sample (raw and recorded) to a
second started with ``--web.enable-remote-write-receiver``; the same queries, asked of both
at one instant, must answer the same."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from fleet_synth import Fleet

from kvscope.localvllm.server import free_port
from tests.stack.promstack import RULE_FILE

FLEET_LEVELS = ("model", "server", "fleet")


SCRAPE_S = 15.0


def serve(fleet: Fleet, live_s: float) -> tuple[ThreadingHTTPServer, int]:
    t0 = time.time()
    bodies = fleet.expositions(t0, t0 + live_s + 120, SCRAPE_S / 3)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            k = int((time.time() - t0) // (SCRAPE_S / 3))
            body = bodies[min(k, len(bodies) - 1)]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            return

    port = free_port()
    httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, port


def answer(base: str, expr: str, at: float) -> set[tuple[frozenset[tuple[str, str]], str]]:
    body = httpx.get(f"{base}/api/v1/query", params={"query": expr, "time": at},
                     timeout=120).json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return {(frozenset(r["metric"].items()), r["value"][1]) for r in body["data"]["result"]}


def compared(queries: dict[str, tuple[str, float]]) -> dict[str, str]:
    """The fleet rules (by their recorded series and their expressions) and the dashboard
    queries: what a global Prometheus behind remote write must answer as the edge does."""
    out = {}
    for name, (expr, _) in queries.items():
        if name.startswith("dashboard "):
            out[name] = expr
        elif name.startswith("rule ") and name[5:].split(":")[0].split("_")[0] in FLEET_LEVELS:
            out[name] = expr
            out[f"series {name[5:]}"] = name[5:]
    return out


def compare_pair(fleet: Fleet, work: Path, queries: dict[str, tuple[str, float]],
                 live_s: float, start: Callable[..., Any]) -> dict[str, Any]:
    httpd, port = serve(fleet, live_s)
    recv, recv_base = start(work, "receiver", work / "recv", {},
                            "--web.enable-remote-write-receiver")
    edge = None
    try:
        edge, edge_base = start(work, "edge", work / "edge", {
            "global": {"scrape_interval": "15s", "evaluation_interval": "15s",
                       "scrape_timeout": "10s"},
            "rule_files": [str(RULE_FILE)],
            "scrape_configs": [{"job_name": "fleet", "honor_labels": True,
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
            "remote_write": [{"url": f"{recv_base}/api/v1/write"}],
        })
        time.sleep(live_s)
        at = float(int(time.time()) - 30)  # remote write delivers within seconds
        out: dict[str, Any] = {"compared": 0, "same": 0, "empty_on_both": 0, "differ": {}}
        answers = {}
        for name, expr in compared(queries).items():
            a, b = answer(edge_base, expr, at), answer(recv_base, expr, at)
            out["compared"] += 1
            answers[name] = len(a)
            if a == b:
                out["same"] += 1
                out["empty_on_both"] += not a
            else:
                out["differ"][name] = {"edge": len(a), "receiver": len(b),
                                       "only_edge": len(a - b), "only_receiver": len(b - a)}
        out["answers"] = answers
        return out
    finally:
        if edge is not None:
            edge.stop()
        recv.stop()
        httpd.shutdown()
