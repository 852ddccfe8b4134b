"""``kvscope demo``: the twin (vLLM's real scheduler), the probe and the sidecar, one command.

The sidecar runs as its own process (``kvscope serve``), exactly as in production; the
twin runs here with the probe attached and streams to it over an ipc socket. The
summary at the end is read back from the sidecar, so it shows what kvscope measured.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvscope.twin import TwinConfig, WorkloadSpec, generate


class DemoError(RuntimeError):
    pass


def start_sidecar(endpoint: str, port: int, data_dir: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kvscope", "serve", "--endpoint", endpoint,
           "--port", str(port), "--log-level", "warning",
           "--decision-log", str(data_dir / "decisions.jsonl"), "--data-dir", str(data_dir)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DemoError(f"the sidecar exited with code {proc.returncode} "
                            f"(is port {port} in use? try --port)")
        try:
            httpx.get(f"{base}/healthz", timeout=1.0)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_process(proc)
    raise DemoError("the sidecar did not answer within 60 s")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


class Progress:
    """One status line, rewritten in place on a terminal, printed every 5 s otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stdout.isatty()
        self.last = 0.0
        self.preemptions = 0

    def __call__(self, step: int, out: Any, sched: Any) -> None:
        self.preemptions += len(out.preempted_req_ids)
        now = time.monotonic()
        if now - self.last < (0.25 if self.tty else 5.0):
            return
        self.last = now
        pool = sched.kv_cache_manager.block_pool
        line = (f"step {step:6d}  running {len(sched.running):3d}  waiting {len(sched.waiting):3d}"
                f"  free blocks {pool.get_num_free_blocks():5d}/{pool.num_gpu_blocks - 1}"
                f"  preemptions {self.preemptions:4d}")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", flush=True)


def wait_caught_up(base: str, steps: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """The sidecar's view of the engine once it has every step of the run."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        engines = httpx.get(f"{base}/api/engines", timeout=5.0).json()["engines"]
        if engines:
            last = engines[0]
            if last["steps"] >= steps:
                return last
        time.sleep(0.2)
    raise DemoError(f"the sidecar saw {last.get('steps', 0)} of {steps} steps within "
                    f"{timeout_s:.0f} s")


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summary_lines(e: dict[str, Any]) -> list[str]:
    pre = e["preemptions"]
    usable = e["num_blocks"] - 1
    util = e["mean_budget_utilization"]
    util0 = e["mean_budget_utilization_when_no_free_blocks"]
    recent = e["recent_preemptions"]
    lines = [
        f"steps                         {e['steps']}",
        f"preemptions                   {sum(pre.values())}  (kv_full {pre['kv_full']}, "
        f"priority {pre['priority']}, unknown {pre['unknown']})",
        f"computed tokens discarded     {e['preempted_tokens']}  "
        f"(recomputed {e['recomputed_tokens']})",
        f"peak usage                    {e['peak_used_blocks']}/{usable} blocks "
        f"({pct(e['peak_used_blocks'] / usable if usable else None)})",
        f"lowest free blocks            {e['lowest_free_blocks']}",
        f"lowest max contiguous free    {e['lowest_max_contiguous_free_blocks']} (sampled)",
        f"mean token-budget utilization {pct(util)}",
        f"  ... on steps with 0 free    {pct(util0)} over {e['steps_with_no_free_blocks']} steps",
    ]
    if recent:
        short = [p for p in recent if p["blocks_needed"] is not None
                 and p["blocks_needed"] > p["free_blocks"]]
        lines.append(f"last {len(recent)} preemptions: {len(short)} needed more blocks than "
                     "were free in total; contiguity is never required by vLLM V1")
    return lines


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    sock_dir = Path(tempfile.mkdtemp(prefix="kvscope-demo-"))
    endpoint = f"ipc://{sock_dir}/probe.sock"
    base = f"http://127.0.0.1:{args.port}"
    cfg = TwinConfig(num_blocks=args.blocks, policy=args.policy)
    spec = WorkloadSpec(n_requests=args.requests, seed=args.seed)
    errors = cfg.validate() + spec.validate()
    if errors:
        print("kvscope demo: " + "; ".join(errors), file=sys.stderr)
        return 2
    try:
        sidecar = start_sidecar(endpoint, args.port, sock_dir)
    except DemoError as exc:
        print(f"kvscope demo: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"kvscope sidecar: {base}/metrics   (engine summary: {base}/api/engines)")
        print(f"live block layout: {base}/ui")
        print(f"decision log:    {sock_dir / 'decisions.jsonl'}")
        print("loading vLLM's scheduler (the twin: vLLM's real Scheduler, no model)...",
              flush=True)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from kvscope.probe import plugin
        from kvscope.twin.engine import Twin

        if not plugin.enable(endpoint):
            print("kvscope demo: the probe could not attach to this vLLM", file=sys.stderr)
            return 1
        twin = Twin(cfg, seed=args.seed)
        requests = generate(spec)
        print(f"workload: {len(requests)} requests (seed {args.seed}), {args.blocks} blocks "
              f"of {cfg.block_size} tokens, policy {args.policy}, token budget "
              f"{cfg.max_num_batched_tokens}/step, max {cfg.max_num_seqs} running")
        progress = Progress(len(requests))
        result = twin.run(requests, on_step=lambda i, out: progress(i, out, twin.scheduler),
                          step_interval_s=args.step_ms / 1000.0)
        plugin.stop_all()
        print(("\n" if progress.tty else "") + f"workload done: {result.finished} requests "
              f"finished in {result.steps} steps ({result.wall_seconds:.1f} s)")
        engine = wait_caught_up(base, result.steps)
        print("\nwhat kvscope measured (from the sidecar):")
        for line in summary_lines(engine):
            print("  " + line)
        print(f"\nPrometheus metrics: {base}/metrics   (Ctrl-C to stop)", flush=True)
        remaining = None if args.duration is None else args.duration - (time.monotonic() - started)
        if remaining is None:
            while sidecar.poll() is None:
                time.sleep(1.0)
        elif remaining > 0:
            time.sleep(remaining)
        return 0
    except KeyboardInterrupt:
        return 130
    except DemoError as exc:
        print(f"kvscope demo: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_process(sidecar)
