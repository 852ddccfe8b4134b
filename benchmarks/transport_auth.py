"""What CURVE on tcp costs the probe's sender thread, against plain ipc, side by side.

A real sidecar ``Receiver`` (with its ingest thread and a Hub) runs in this process; a
PUSH socket from ``kvscope_probe.transport`` sends the same frames to it over ipc (no
authentication) and over tcp with CURVE, alternating rounds. Reported per frame size: CPU
time per frame of the sending thread (the probe's sender thread; never vLLM's engine
thread) and of the whole process (both ends, with libzmq's I/O threads, where CURVE
encrypts and decrypts), and end-to-end frames per second until the hub accepted all.

    .venv/bin/python benchmarks/transport_auth.py [--quick] [--rounds N] [--out DIR]

A report, never an assertion: it exits 0 whatever the figures are.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import median

from kvscope.localvllm.server import free_port
from kvscope.sidecar.ingest.receiver import Receiver
from kvscope.state.hub import Hub
from kvscope_probe import transport, wire

SECRET = b"benchmark-secret-0123456789abcdef"
SIZES = (64, 65536)
"""Pool sizes of the keyframes sent: one byte of state per block."""


def frames(n_blocks: int, count: int) -> list[list[bytes]]:
    h = wire.Hello(engine="0", session=f"b{n_blocks}", pid=1, vllm_version="bench",
                   model="m", num_blocks=n_blocks, block_size=32,
                   kv_groups=[wire.KVGroup("FullAttentionSpec", 32)], token_budget=512,
                   max_num_batched_tokens=512, max_num_seqs=32, policy="fcfs",
                   prefix_caching=True, ts=1.0)
    states = bytes([3] + [0] * (n_blocks - 1))
    return [wire.encode(wire.Frame(engine="0", session=h.session, first_seq=i, dropped=0,
                                   faults=0, records=[wire.Keyframe(h, states, {}, {})]))
            for i in range(count)]


def one_round(endpoint: str, payload: list[list[bytes]]) -> tuple[float, float, float]:
    """(sender-thread and process CPU seconds per frame, frames per second end to end)."""
    hub = Hub()
    rx = Receiver(hub, [endpoint], secret=SECRET if transport.requires_auth(endpoint) else None)
    rx.bind()
    rx.start()
    sock = transport.push_socket(endpoint, hwm=100_000, secret=SECRET)
    try:
        transport.send(sock, payload[0], 5000)  # connected and authenticated first
        while hub.frames < 1:
            time.sleep(0.005)
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        for parts in payload[1:]:
            while not transport.send(sock, parts, 1000):
                pass
        cpu = time.thread_time() - c0
        while hub.frames < len(payload):
            time.sleep(0.001)
        wall, proc = time.perf_counter() - t0, time.process_time() - p0
    finally:
        sock.close(0)
        rx.stop()
    n = len(payload) - 1
    return cpu / n, proc / n, n / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    count = 300 if args.quick else 2000
    rounds = 1 if args.quick else args.rounds
    out = args.out or Path(tempfile.mkdtemp(prefix="kvscope-transport-"))
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, dict[str, float]] = {}
    print(f"{'frame':>10s} | {'sender thread us/frame':^26s} | {'process us/frame':^26s} | "
          f"{'frames/s':^24s}\n{'':>10s} | {'ipc':>7s} {'CURVE':>7s} {'ratio':>6s}    | "
          f"{'ipc':>7s} {'CURVE':>7s} {'ratio':>6s}    | {'ipc':>7s} {'CURVE':>7s} {'ratio':>6s}")
    for n_blocks in SIZES:
        payload = frames(n_blocks, count)
        name = f"{len(payload[0][1]) / 1024:.1f} KiB"
        got: dict[str, list[tuple[float, float, float]]] = {"ipc": [], "curve": []}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(rounds):
                got["ipc"].append(one_round(f"ipc://{tmp}/b{r}.sock", payload))
                got["curve"].append(one_round(f"tcp://127.0.0.1:{free_port()}", payload))
        cols = [{k: median([x[i] for x in v]) for k, v in got.items()} for i in range(3)]
        s = summary[name] = {}
        cells = []
        for label, col, scale in (("thread_us", cols[0], 1e6), ("process_us", cols[1], 1e6),
                                  ("fps", cols[2], 1.0)):
            s[f"ipc_{label}"], s[f"curve_{label}"] = col["ipc"] * scale, col["curve"] * scale
            s[f"{label}_ratio"] = col["curve"] / col["ipc"]
            cells.append(f"{s[f'ipc_{label}']:7.1f} {s[f'curve_{label}']:7.1f} "
                         f"{s[f'{label}_ratio']:6.2f}   ")
        print(f"{name:>10s} | " + " | ".join(cells))
    line = json.dumps({"benchmark": "transport_auth", "frames": count, "rounds": rounds,
                       "results": summary})
    (out / "summary.json").write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
