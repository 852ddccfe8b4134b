"""CPU and memory of ``kvscope serve`` run as the Kubernetes pod runs it: what the sidecar's
resource requests and limits (deploy/kubernetes) are sized from.

    python benchmarks/sidecar_footprint.py [--pool 131072] [--requests 1200] [--dsn DSN]

The sidecar gets the pod's flags (ipc endpoint, ``--vllm-url``, decision log on stdout,
ClickHouse over HTTP), on loopback without a token. The default DSN points at a closed
port, so every row goes through the on-disk spool (a ClickHouse outage: the sidecar's
costliest steady state). The feed is probe_step_cost.py's workload on vLLM's real
scheduler (the twin, probe on), run as fast as the scheduler goes: more steps per second
than a GPU server makes. Prints one JSON line: idle and peak RSS (VmHWM), CPU seconds, CPU
per step and per wall second of the feed, and the spool's size. A report, never an assertion.
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
from typing import Any

import httpx
from _common import HOST, free_port, process_cpu_s, scrape

from kvscope.procs import stop_process

FEED = """
import os, sys
sys.path.insert(0, {bench!r})
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
from twin_run import twin_config, workload
from kvscope.twin.engine import Twin
from kvscope_probe import plugin
plugin.enable({endpoint!r})
twin = Twin(twin_config({pool}))
reqs = workload({requests})
print("READY", flush=True)
sys.stdin.readline()
steps = twin.run(reqs).steps
plugin.stop_all()
print("DONE", steps, flush=True)
"""


def rss_mib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in MiB."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines())
    return int(status["VmRSS"].split()[0]) >> 10, int(status["VmHWM"].split()[0]) >> 10


def start_sidecar(work: Path, endpoint: str, port: int, dsn: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    env["KVSCOPE_CLICKHOUSE_DSN"] = dsn
    argv = [sys.executable, "-m", "kvscope", "serve", f"--endpoint={endpoint}",
            f"--port={port}", f"--vllm-url=http://{HOST}:9", f"--data-dir={work}/data",
            "--decision-log=-", "--log-level=warning"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(work / "side.log", "wb"),
                            env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            url = f"http://{HOST}:{port}/api/engines"
            if httpx.get(url, timeout=1, trust_env=False).is_success:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_process(proc, 10, group=True)
    raise RuntimeError(f"kvscope serve did not answer; see {work / 'side.log'}")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvscope-footprint-"))
    endpoint, port = f"ipc://{work}/run/probe.sock", free_port()
    side = start_sidecar(work, endpoint, port, args.dsn)
    feed = None
    try:
        idle, _ = rss_mib(side.pid)
        code = FEED.format(bench=str(Path(__file__).parent), endpoint=endpoint,
                           pool=args.pool, requests=args.requests)
        feed = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert feed.stdin and feed.stdout and feed.stdout.readline().startswith("READY")
        cpu0, t0 = process_cpu_s(side.pid), time.monotonic()
        feed.stdin.write("go\n")
        feed.stdin.flush()
        steps = int(feed.stdout.readline().split()[1])
        feed.wait(60)
        time.sleep(3)  # let the sidecar drain what is queued
        cpu, wall = process_cpu_s(side.pid) - cpu0, time.monotonic() - t0
        rss, peak = rss_mib(side.pid)
        spool = sum(v for (name, _), v in scrape(f"http://{HOST}:{port}").items()
                    if name == "kvscope_sink_spool_bytes")
    finally:
        if feed is not None:
            stop_process(feed, 10, group=True)
        stop_process(side, 10, group=True)
    return {"benchmark": "sidecar_footprint", "pool_blocks": args.pool,
            "requests": args.requests, "steps": steps, "feed_wall_s": round(wall, 1),
            "steps_per_s": round(steps / wall, 1), "idle_rss_mib": idle,
            "rss_after_mib": rss, "peak_rss_mib": peak, "cpu_s": round(cpu, 2),
            "cpu_us_per_step": round(cpu / steps * 1e6, 1), "cores": round(cpu / wall, 3),
            "spool_mib": round(spool / (1 << 20), 1), "loadavg_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--pool", type=int, default=131072, help="KV blocks in the pool")
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--dsn", default=f"http://kvscope:x@{HOST}:9/kvscope",
                    help="ClickHouse DSN (default: a closed port, so rows are spooled)")
    print(json.dumps(measure(ap.parse_args())))


if __name__ == "__main__":
    main()
