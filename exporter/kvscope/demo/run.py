"""``kvscope demo``: every layer of kvscope, live, with one command and no GPU.

A sidecar (``kvscope serve``, its own process, as in production) receives the probe's
records from an engine: the twin (vLLM's real scheduler, no model, in this process) or a
real vLLM server on the CPU. Four simulated applications send a seeded workload through
kvscope's client SDK to the engine's OpenAI API, where kvscope's middleware tags each
request. While it runs, a live view shows the pool, the budget, preemptions and the
clients; at the end the demo prints findings computed from what the sidecar recorded
(metrics, ClickHouse rows, the decision log, client correlation) and the pages and
queries to look at next, then keeps the sidecar serving until Ctrl-C or ``--duration``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvscope import procs
from kvscope.demo.engines import DemoError, Engine, TwinEngine, VllmEngine
from kvscope.demo.findings import collect, findings, most_preempted, next_steps, settle
from kvscope.demo.live import LiveView
from kvscope.demo.workload import PERSONAS, Workload, plan
from kvscope.twin import TwinConfig

DEFAULT_BLOCKS = {"full": 64, "full+sliding": 128, "sliding": 48, "mamba-hybrid": 64}
"""Pools that preempt under the demo's load and that vLLM accepts for each layout (with
either scheduler): every group of a layout takes blocks from the one pool."""


def check_port(port: int) -> None:
    """Fail early when the sidecar's port is taken: another kvscope would answer for it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise DemoError(f"port {port} is in use (another kvscope?); try --port") from None


def launch_sidecar(endpoint: str, port: int, workdir: Path,
                   vllm_url: str | None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kvscope", "serve", "--endpoint", endpoint,
           "--port", str(port), "--log-level", "warning",
           "--decision-log", str(workdir / "decisions.jsonl"), "--data-dir", str(workdir),
           "--clickhouse-dsn", f"chdb://{workdir / 'chdb'}",
           # the findings are read seconds after the run: rows gathered and inserted a
           # second at a time
           "--clickhouse-batch-interval", "1", "--clickhouse-insert-interval", "1"]
    if vllm_url:
        cmd += ["--vllm-url", vllm_url, "--vllm-scrape-interval", "1"]
    # The flags say everything; a KVSCOPE_TOKEN or TLS setting meant for a production
    # sidecar must not lock the demo out of its own one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    with (workdir / "sidecar.log").open("ab") as log:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, env=env,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_sidecar(proc: subprocess.Popen[bytes], base: str, log: Path,
                 timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise DemoError(f"the sidecar exited with code {proc.returncode} (is the port in "
                            f"use? try --port): " + " | ".join(tail))
        try:
            httpx.get(f"{base}/healthz", timeout=1.0, trust_env=False)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise DemoError(f"the sidecar did not answer within {timeout_s:.0f} s; log {log}")


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    procs.stop_process(proc, timeout_s)


async def drive(workload: Workload, view: LiveView, engine: Engine,
                deadline: float | None) -> bool:
    """Run the workload with the live view; False when ``deadline`` cut it off."""
    stop = asyncio.Event()
    shown = asyncio.create_task(view.run(stop))
    work = asyncio.create_task(workload.run())
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=0.5)
            failure = engine.failure()
            if failure:
                raise DemoError(failure)
            if deadline is not None and time.monotonic() > deadline:
                return False
        work.result()
        return True
    finally:
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        stop.set()
        await shown


def describe(args: argparse.Namespace, cfg: TwinConfig, engine: Engine, base: str,
             workdir: Path) -> list[str]:
    kind = ("the twin engine (vLLM's real scheduler, no model, one step per "
            f"{args.step_ms:g} ms)" if engine.name == "twin"
            else "a real vLLM server on the CPU with a tiny generated model")
    return [
        f"kvscope demo: {args.requests} requests from {len(PERSONAS)} clients (seed "
        f"{args.seed}) to {kind}",
        f"  pool         {cfg.num_blocks} blocks of {cfg.block_size} tokens, policy "
        f"{cfg.policy}, token budget {cfg.max_num_batched_tokens}/step, at most "
        f"{cfg.max_num_seqs} running",
        f"  layout       {cfg.layout_summary()}",
        f"  clients      {', '.join(p.client_id for p in PERSONAS if p.reads_sidecar)} read "
        f"/health/preempt-rate; {', '.join(p.client_id for p in PERSONAS if not p.reads_sidecar)}"
        " does not, and sends some prompts twice",
        f"  sidecar      {base}/metrics   block layout {base}/ui",
        f"  ClickHouse   chdb://{workdir / 'chdb'}   decision log {workdir / 'decisions.jsonl'}",
    ]


def make_engine(args: argparse.Namespace, cfg: TwinConfig, endpoint: str,
                workdir: Path) -> Engine:
    if args.engine == "vllm":
        return VllmEngine(cfg, endpoint, workdir)
    return TwinEngine(cfg, args.seed, args.step_ms / 1000.0, endpoint)


def validate(args: argparse.Namespace, cfg: TwinConfig) -> list[str]:
    errors = cfg.validate()
    if args.engine == "vllm":
        # The CPU build serves the tiny Llama (full attention) and schedules synchronously.
        twin_only = [flag for flag, on in (
            (f"--layout {cfg.layout}", cfg.layout != "full"),
            ("--async-scheduling", cfg.async_scheduling),
            ("--speculative-tokens", cfg.num_speculative_tokens > 0),
        ) if on]
        if twin_only:
            errors.append(f"{', '.join(twin_only)} needs --engine twin: the CPU vLLM server "
                          "serves a full-attention model with the synchronous scheduler.")
    if args.requests < 1:
        errors.append(f"--requests must be at least 1, got {args.requests}.")
    if not args.step_ms > 0:
        errors.append(f"--step-ms must be positive, got {args.step_ms}.")
    if args.duration is not None and not args.duration > 0:
        errors.append(f"--duration must be positive, got {args.duration}.")
    if not 0 < args.port < 65536:
        errors.append(f"--port must be in 1..65535, got {args.port}.")
    return errors


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: the sidecar and the engine must not be orphaned."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = None if args.duration is None else started + args.duration
    blocks = DEFAULT_BLOCKS[args.layout] if args.blocks is None else args.blocks
    cfg = TwinConfig(
        num_blocks=blocks, policy=args.policy, layout=args.layout,
        sliding_window=args.sliding_window, async_scheduling=args.async_scheduling,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    errors = validate(args, cfg)
    if errors:
        print("kvscope demo: " + " ".join(errors), file=sys.stderr)
        return 2
    workdir = Path(args.data_dir or tempfile.mkdtemp(prefix="kvscope-demo-")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    stack = contextlib.ExitStack()
    stack.callback(signal.signal, signal.SIGTERM, signal.signal(signal.SIGTERM, _terminate))
    try:
        return _run(args, cfg, workdir, deadline, stack)
    except KeyboardInterrupt as exc:
        term = isinstance(exc, Terminated)
        print(f"\nkvscope demo: stopped ({'SIGTERM' if term else 'Ctrl-C'})", flush=True)
        return 143 if term else 130
    except DemoError as exc:
        print(f"kvscope demo: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C (or SIGTERM) must not cut the clean-up short.
        previous = [signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)]
        try:
            stack.close()
        finally:
            signal.signal(signal.SIGINT, previous[0])


def _run(args: argparse.Namespace, cfg: TwinConfig, workdir: Path, deadline: float | None,
         stack: contextlib.ExitStack) -> int:
    endpoint = f"ipc://{workdir}/probe.sock"
    base = f"http://127.0.0.1:{args.port}"
    check_port(args.port)
    engine = make_engine(args, cfg, endpoint, workdir)
    sidecar = launch_sidecar(endpoint, args.port, workdir,
                             engine.url if engine.name == "vllm" else None)
    stack.callback(stop_process, sidecar)
    for line in describe(args, cfg, engine, base, workdir):
        print(line)
    print("starting the engine (loading vLLM takes a few seconds)...", flush=True)
    stack.callback(engine.stop)
    engine.start()
    print(f"  OpenAI API   {engine.url}/v1 (kvscope middleware; clients use kvscope's SDK)")
    wait_sidecar(sidecar, base, workdir / "sidecar.log")
    workload = Workload(plan(args.requests, args.seed, args.step_ms / 1000.0), engine.url,
                        engine.model, base, send_priority=cfg.policy == "priority")
    view = LiveView(base, engine.name, workload)
    t0 = time.monotonic()
    complete = asyncio.run(drive(workload, view, engine, deadline))
    failed = sum(t.failed for t in workload.tallies.values())
    print(f"\nworkload {'done' if complete else 'cut off by --duration'}: {workload.done}/"
          f"{workload.total} requests answered ({failed} failed) in "
          f"{time.monotonic() - t0:.1f} s; waiting for the sidecar to store everything...",
          flush=True)
    for t in workload.tallies.values():
        for err in t.errors:
            print(f"  error: {err}")
    scrape = settle(base, engine.steps(), workload.done - failed,
                    timeout_s=20.0 if complete else 5.0)
    ev = collect(base, workdir / "decisions.jsonl", scrape, view.trend, workload)
    print("\nfindings (computed from what the sidecar recorded):")
    for line in findings(ev):
        print("  " + line)
    print("\nlook next:")
    for line in next_steps(base, workdir, workdir / "decisions.jsonl",
                           most_preempted(ev.decisions)):
        print("  " + line)
    if deadline is not None and time.monotonic() >= deadline:
        print("\n--duration reached: stopping", flush=True)
        return 0
    until = "" if deadline is None else f" for {deadline - time.monotonic():.0f} s"
    print(f"\nthe sidecar keeps serving {base}{until} (Ctrl-C to stop)", flush=True)
    while deadline is None or time.monotonic() < deadline:
        if sidecar.poll() is not None:
            raise DemoError(f"the sidecar exited with code {sidecar.returncode}; "
                            f"log {workdir / 'sidecar.log'}")
        time.sleep(0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic())))
    return 0
