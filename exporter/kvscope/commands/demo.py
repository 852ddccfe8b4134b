"""``kvscope demo``: every layer live in one command, no GPU (``kvscope.demo.run``)."""

from __future__ import annotations

import argparse
from typing import Any

from kvscope.twin.config import LAYOUTS, TwinConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    demo = subparsers.add_parser(
        "demo", help="every layer live in one command, no GPU: an engine, the probe, the "
                     "sidecar, clients through the SDK, findings at the end")
    demo.add_argument("--engine", choices=("twin", "vllm"), default="twin",
                      help="twin: vLLM's real scheduler in-process, no model (default); "
                           "vllm: a real vLLM server on the CPU with a tiny generated model")
    demo.add_argument("--port", type=int, default=9477, help="sidecar HTTP port (default 9477)")
    demo.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds, cutting the workload short if need be "
             "(default: run the workload, then serve until Ctrl-C)",
    )
    demo.add_argument(
        "--step-ms",
        type=float,
        default=10.0,
        help="pace of the twin's scheduler steps in ms; the workload's arrival waves are "
             "spaced in steps, so this also paces the clients (default 10)",
    )
    demo.add_argument("--requests", type=int, default=200,
                      help="requests the clients send, duplicates included (default 200)")
    demo.add_argument("--blocks", type=int, default=None,
                      help="KV blocks in the pool (default 64; 128 for full+sliding, 48 for "
                           "sliding)")
    demo.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    demo.add_argument("--layout", choices=LAYOUTS, default="full",
                      help="the model's KV layout, twin only (default full: one "
                           "full-attention group)")
    demo.add_argument("--sliding-window", type=int, default=TwinConfig.sliding_window,
                      metavar="TOKENS", help="window of the sliding-window layers "
                      f"(default {TwinConfig.sliding_window})")
    demo.add_argument("--async-scheduling", action="store_true",
                      help="vLLM's AsyncScheduler, one step in flight (the GPU default; "
                           "twin only)")
    demo.add_argument("--speculative-tokens", dest="num_speculative_tokens", type=int,
                      default=0, metavar="N", help="draft tokens per step of a "
                      "draft-model speculator, with N lookahead slots (twin only; default 0)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    demo.add_argument("--data-dir",
                      help="where the store, decision log and logs go (default: a new "
                           "temporary directory, kept after the demo)")
    demo.set_defaults(run=run)
    return demo


def run(args: argparse.Namespace) -> int:
    from kvscope.demo.run import run_demo

    return run_demo(args)
