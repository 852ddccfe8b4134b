"""The API server's event-loop time the middleware spends reading one request body, this
checkout against another (``--against CHECKOUT``'s ``exporter``), in a fresh process each.

    .venv/bin/python benchmarks/middleware_body.py [--mib 16] [--chunk-kib 16] [--against DIR]

The body (``--mib``, at most the middleware's ``MAX_BODY``) arrives in ``--chunk-kib``
messages as an ASGI server hands them over; the app behind reads nothing. CPU time of the
thread running the loop (``time.thread_time``) for the whole call, least of 3. A report:
exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ONE = """
import asyncio, sys, time
from kvscope_probe.middleware import KVScopeMiddleware

class Discard:
    def emit(self, event): pass

async def app(scope, receive, send): pass

async def call(chunk, n):
    mw = KVScopeMiddleware(app)
    mw.emitter = Discard()
    msgs = iter([{"type": "http.request", "body": b"x" * chunk, "more_body": i < n - 1}
                 for i in range(n)])
    async def receive(): return next(msgs)
    async def send(m): pass
    t = time.thread_time()
    await mw({"type": "http", "path": "/v1/completions", "method": "POST", "headers": []},
             receive, send)
    return time.thread_time() - t

chunk, n = int(sys.argv[1]), int(sys.argv[2])
print(min(asyncio.run(call(chunk, n)) for _ in range(3)))
"""


def run(exporter: Path, chunk: int, n: int) -> float:
    out = subprocess.run([sys.executable, "-c", ONE, str(chunk), str(n)], check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(exporter)})
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=16)
    ap.add_argument("--chunk-kib", type=int, default=16)
    ap.add_argument("--against", type=Path)
    a = ap.parse_args()
    chunk = a.chunk_kib * 1024
    n = max(1, int(a.mib * 1024 * 1024) // chunk)
    trees = {"this": HERE.parent / "exporter"}
    if a.against:
        trees["against"] = a.against / "exporter"
    res = {name: run(path, chunk, n) for name, path in trees.items()}
    for name, s in res.items():
        print(f"{name:8} {n} chunks of {a.chunk_kib} KiB: {s * 1000:.1f} ms of the loop")
    print(json.dumps({"chunks": n, "chunk_kib": a.chunk_kib, "loop_s": res}))


if __name__ == "__main__":
    main()
