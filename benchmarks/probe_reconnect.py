"""What the probe's socket costs the engine process while no sidecar listens.

    python benchmarks/probe_reconnect.py [--seconds 10] [--settle 3] [--rounds 2]

libzmq retries a connection that nothing accepts on the probe context's I/O thread. Each
round runs two fresh processes in turn, each opening one ``transport.push_socket`` to an
endpoint nobody binds: ``backoff`` as the probe does (``RECONNECT_IVL_MAX_MS``) and
``every-100ms`` with that option 0 before it connects (libzmq's default: a retry every
100 ms; the option is read when the socket connects).
After ``--settle`` seconds (the first, quicker retries) it reads the CPU the context's
threads used over ``--seconds`` (``iothreads.IoCpu``, each thread's CPU clock), for an ipc
and a tcp endpoint. A report, never an assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def child(kind: str, variant: str, settle: float, seconds: float) -> None:
    import zmq

    from kvscope_probe import iothreads, transport

    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/nobody.sock" if kind == "ipc" else "tcp://127.0.0.1:1"
        if variant == "every-100ms":  # read by push_socket as it sets the socket up
            transport.RECONNECT_IVL_MAX_MS = 0
        sock = transport.push_socket(endpoint, hwm=16, secret=b"benchmark-secret-" * 2)
        assert sock.getsockopt(zmq.RECONNECT_IVL_MAX) == transport.RECONNECT_IVL_MAX_MS
        io = iothreads.IoCpu()
        time.sleep(settle)
        before = io()
        time.sleep(seconds)
        used = io() - before
        sock.close(0)
    print(json.dumps({"kind": kind, "variant": variant, "io_cpu_ms": used / 1e6,
                      "ms_per_s": used / 1e6 / seconds}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.settle, args.seconds)
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT / "exporter")}
    for r in range(args.rounds):
        for kind in ("ipc", "tcp"):
            for variant in ("backoff", "every-100ms"):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", kind, variant, "--seconds",
                     str(args.seconds), "--settle", str(args.settle)],
                    capture_output=True, text=True, env=env, check=True)
                got = json.loads(done.stdout)
                print(f"round {r + 1} {kind:3} {variant:11}: {got['io_cpu_ms']:7.3f} ms of "
                      f"I/O-thread CPU in {args.seconds:g} s ({got['ms_per_s']:.3f} ms/s)",
                      flush=True)


if __name__ == "__main__":
    main()
