"""``kvscope whatif``: one workload through the twin under several settings, side by side.

Every setting runs the same requests through vLLM's real scheduler (the twin, no model)
with kvscope's probe bound and a sidecar hub fed in-process, so each figure is what
kvscope would report for a server with those flags. Same seed, same output (wall time
goes to stderr with the progress).

  kvscope whatif --block-size 16,32,64 --kv-tokens 1536
  kvscope whatif --policy fcfs,priority --max-seqs 16,32 --format csv
  kvscope whatif --setting small=block_size:16,kv_tokens:1536 --setting big=blocks:96
  kvscope whatif --replay traces.jsonl --block-size 16,32 --kv-bytes 1.5MiB
  kvscope whatif --layout full+sliding --sliding-window 64,256 --blocks 96,128
  kvscope whatif --replay traffic.json --baseline blocks:48 --blocks 64,96
  kvscope whatif --replay traffic.json --safe-concurrency --blocks 48,96

With --baseline (the server's settings) a replay of recorded outcomes (``kvscope query
replay_traffic --format json``) is checked first: the twin's preemptions, preempted
requests, recomputed tokens, peak used blocks and waits against the server's, before any
what-if column (kvscope.whatif.recorded).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kvscope.twin.config import LAYOUTS
from kvscope.whatif.measure import measure
from kvscope.whatif.plan import MIX, Plan, plan
from kvscope.whatif.progress import Progress
from kvscope.whatif.recorded import Fidelity, figures
from kvscope.whatif.report import RENDERERS, Report, timings, write_png
from kvscope.whatif.settings import KEYS, Setting, tiny_model_bytes_per_token

__all__ = ["Plan", "Report", "add_parser", "compare", "plan", "run"]

_AXIS_HELP = {
    "block_size": "tokens per KV block, multiples of 16 (default 32); a CPU vLLM server "
                  "needs multiples of 32, the twin runs no attention",
    "blocks": "pool size in blocks, null block included (default 48)",
    "kv_tokens": "pool size in tokens: blocks = kv_tokens // block_size",
    "kv_bytes": "KV memory (e.g. 1.5MiB): blocks = bytes // (bytes-per-token * block_size)",
    "max_seqs": "most requests running at once (default 32)",
    "budget": "token budget per step, max_num_batched_tokens (default 512)",
    "scheduled_tokens": "vLLM's --max-num-scheduled-tokens: the tokens the scheduler "
                        "fills each step, when fewer than the budget (default auto: the "
                        "budget)",
    "policy": "fcfs or priority (default fcfs)",
    "prefix_caching": "on or off (default on)",
    "layout": f"the model's KV layout: {', '.join(LAYOUTS)} (default full)",
    "groups": "the model's KV cache groups when not the layout's stand-in's, e.g. "
              "sliding*5+full (a Gemma 3 12B); as kvscope query engine_settings lists "
              "them; --model works them out from its layers",
    "sliding_window": "tokens a sliding-window layer attends to (default 128)",
    "async_scheduling": "on: vLLM's AsyncScheduler, one step in flight (default off)",
    "spec_tokens": "draft tokens per step of a draft-model speculator (default 0)",
    "watermark": "vLLM's --watermark: the pool's fraction kept free from waiting and "
                 "preempted requests while any runs (default 0)",
}
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``whatif`` to a ``kvscope`` subparsers object."""
    p = subparsers.add_parser(
        "whatif", help="one workload through vLLM's scheduler under several settings",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("settings (comma-separated values form a grid)")
    for key in KEYS:
        s.add_argument("--" + key.replace("_", "-"), dest=f"axis_{key}", metavar="LIST",
                       help=_AXIS_HELP[key])
    s.add_argument("--setting", action="append", default=[],
                   metavar="[NAME=]KEY:VALUE,...", help="one named setting, repeatable; "
                   "single-valued flags above fill the keys it leaves out")
    s.add_argument("--bytes-per-token", type=int, default=None, metavar="N",
                   help="KV bytes per token for --kv-bytes "
                   f"(default {tiny_model_bytes_per_token()}, the tiny test model)")
    s.add_argument("--model", metavar="NAME|PATH",
                   help="the served model's KV layout (vLLM's KV cache groups of its "
                        "layers) and context (the bound of --max-model-len): a model "
                        "directory or its config.json (no weights read; read through "
                        "vLLM's config loader, with its model type's defaults), or a known model "
                        "(kvscope.models.known: Llama-3-8B, Mistral-7B-v0.1, Qwen2.5-7B, "
                        "Gemma-3-12B, ...); also the default --bytes-per-token; full-attention "
                        "and sliding-window layers only")
    s.add_argument("--max-model-len", type=int, default=1024, metavar="N",
                   help="longest prompt + output, every setting (1024)")
    w = p.add_argument_group("workload (a synthetic mix, or --replay)")
    w.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests in the mix (120); with --replay, replay the first N")
    w.add_argument("--seed", type=int, default=0, metavar="N",
                   help="the mix, its token IDs and sampled tokens (0)")
    for name, (flag, kind, text) in MIX.items():
        metavar = {"range": "LOW:HIGH", float: "FRACTION", int: "N"}[kind]
        w.add_argument(flag, dest=f"mix_{name}", type=str if kind == "range" else kind,
                       default=None, metavar=metavar, help=text)
    w.add_argument("--replay", type=Path, metavar="FILE",
                   help="JSON/JSONL per-request records (request_traces rows work)")
    w.add_argument("--baseline", metavar="KEY:VALUE,...",
                   help="with --replay of recorded outcomes (kvscope query replay_traffic): "
                   "the settings the server ran with, as in --setting; replayed first, and "
                   "its error against the server's own figures reported before the rest")
    w.add_argument("--replay-step-ms", type=float, default=20.0, metavar="MS",
                   help="milliseconds per scheduler step, to turn arrival seconds into "
                   "steps (20)")
    o = p.add_argument_group("output")
    o.add_argument("--format", choices=sorted(RENDERERS), default="table",
                   help="table (settings as columns), json, or csv (a row per setting)")
    o.add_argument("--safe-concurrency", action="store_true",
                   help="instead of the comparison: per setting, the most requests of this "
                   "traffic in flight at once with no preemption (kvscope whatif.concurrency)")
    o.add_argument("--png", type=Path, metavar="FILE", help="also draw bar charts")
    o.add_argument("--max-steps", type=int, default=1_000_000, metavar="N",
                   help="stop a setting's run after this many steps (1000000)")
    o.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)
    return p


def compare(p: Plan, *, seed: int, max_steps: int | None = None,
            progress: Progress | None = None) -> Report:
    """Measure every setting of ``p`` on its requests; with a baseline, that first (as
    the first column) and the fidelity of its replay."""
    settings = ([p.baseline] if p.baseline else []) + p.settings
    columns = []
    for i, setting in enumerate(settings, 1):
        if progress:
            progress.start(i, setting.name)
        m = measure(setting.config, p.requests, seed=seed, max_steps=max_steps,
                    on_step=progress.step if progress else None)
        if progress:
            progress.done(m)
        columns.append((setting, m))
    fidelity = None
    if p.baseline is not None:
        m = columns[0][1]
        fidelity = Fidelity(p.baseline.name, figures(p.records, m.usable_blocks),
                            figures(m.records, m.usable_blocks))
    return Report(p.workload, columns, p.notes, fidelity, p.left_out)


def refusals(settings: list[Setting]) -> list[str]:
    """Settings vLLM would not start with (its own check of the pool for the layout, as a
    server runs it at start), one line each; building a scheduler takes milliseconds."""
    from kvscope.twin.scheduler import build_scheduler

    out = []
    for setting in settings:
        try:
            build_scheduler(setting.config)
        except ValueError as exc:
            out.append(f"setting {setting.name}: {exc}")
    return out


def run(args: argparse.Namespace) -> int:
    """``kvscope whatif``; 0 when done, 2 on bad arguments, 1 when a run failed."""
    work, errors = plan(args)
    if work is None:
        print("kvscope whatif: invalid arguments:\n  - " + "\n  - ".join(errors),
              file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    settings = ([work.baseline] if work.baseline else []) + work.settings
    progress = Progress(len(settings), quiet=args.quiet)
    if not args.quiet:
        print(f"{len(settings)} settings x {len(work.requests)} requests; loading "
              "vLLM's scheduler...", file=sys.stderr, flush=True)
    try:
        refused = refusals(settings)
        if refused:
            print("kvscope whatif: vLLM refuses these settings:\n  - " + "\n  - ".join(refused),
                  file=sys.stderr)
            return 2
        if args.safe_concurrency:
            from kvscope.whatif import safe
            from kvscope.whatif.client import recorded_client

            def done(i: int, s: Setting, a: Any) -> None:
                if not args.quiet:
                    print(f"[{i}/{len(settings)}] {s.name}: safe concurrency {a.safe}",
                          file=sys.stderr, flush=True)

            client = recorded_client(work.records)
            results = safe.answers(settings, work.requests, seed=args.seed, client=client,
                                   on_done=done)
            sys.stdout.write(safe.render(args.format, work.workload, results, client))
            return 0
        report = compare(work, seed=args.seed, max_steps=args.max_steps, progress=progress)
    except ImportError as exc:
        print(f"kvscope whatif: needs vLLM importable (pip install 'kvscope[vllm]'): {exc}",
              file=sys.stderr)
        return 1
    sys.stdout.write(RENDERERS[args.format](report))
    sys.stdout.flush()
    if args.png is not None:
        try:
            width, height = write_png(report, args.png)
        except OSError as exc:
            print(f"kvscope whatif: cannot write {args.png}: {exc}", file=sys.stderr)
            return 1
        if not args.quiet:
            print(f"wrote {args.png} ({width}x{height})", file=sys.stderr)
    if not args.quiet:
        print(timings(report), file=sys.stderr)
    return 1 if any(m.faults for _, m in report.columns) else 0

