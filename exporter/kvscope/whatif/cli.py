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
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvscope.twin.config import LAYOUTS
from kvscope.twin.workload import TwinRequest, WorkloadSpec, generate
from kvscope.whatif.measure import Measurement, measure
from kvscope.whatif.replay import ReplayError, load
from kvscope.whatif.report import RENDERERS, Report, timings, write_png
from kvscope.whatif.settings import KEYS, Setting, build, tiny_model_bytes_per_token

_AXIS_HELP = {
    "block_size": "tokens per KV block, multiples of 16 (default 32); a CPU vLLM server "
                  "needs multiples of 32, the twin runs no attention",
    "blocks": "pool size in blocks, null block included (default 48)",
    "kv_tokens": "pool size in tokens: blocks = kv_tokens // block_size",
    "kv_bytes": "KV memory (e.g. 1.5MiB): blocks = bytes // (bytes-per-token * block_size)",
    "max_seqs": "most requests running at once (default 32)",
    "budget": "token budget per step, max_num_batched_tokens (default 512)",
    "policy": "fcfs or priority (default fcfs)",
    "prefix_caching": "on or off (default on)",
    "layout": f"the model's KV layout: {', '.join(LAYOUTS)} (default full)",
    "sliding_window": "tokens a sliding-window layer attends to (default 128)",
    "async_scheduling": "on: vLLM's AsyncScheduler, one step in flight (default off)",
    "spec_tokens": "draft tokens per step of a draft-model speculator (default 0)",
}
# WorkloadSpec field -> (flag, type, help); ranges are LOW:HIGH.
_MIX = {
    "short_fraction": ("--short-fraction", float, "share of short prompts (0.7)"),
    "short_prompt": ("--short-prompt", "range", "short prompt tokens (8:48)"),
    "long_prompt": ("--long-prompt", "range", "long prompt tokens before the prefix (300:700)"),
    "shared_prefix_fraction": ("--shared-prefix-fraction", float,
                               "share of long prompts with the shared prefix (0.5)"),
    "shared_prefix_len": ("--shared-prefix-len", int, "shared prefix tokens (256)"),
    "max_tokens": ("--max-tokens", "range", "output tokens (32:256)"),
    "waves": ("--waves", int, "arrival waves (4)"),
    "wave_interval_steps": ("--wave-interval", int, "steps between waves (20)"),
    "priorities": ("--priorities", "range", "priority range, lower first (0:3)"),
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
    s.add_argument("--max-model-len", type=int, default=1024, metavar="N",
                   help="longest prompt + output, every setting (1024)")
    w = p.add_argument_group("workload (a synthetic mix, or --replay)")
    w.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests in the mix (120); with --replay, replay the first N")
    w.add_argument("--seed", type=int, default=0, metavar="N",
                   help="the mix, its token IDs and sampled tokens (0)")
    for name, (flag, kind, text) in _MIX.items():
        metavar = {"range": "LOW:HIGH", float: "FRACTION", int: "N"}[kind]
        w.add_argument(flag, dest=f"mix_{name}", type=str if kind == "range" else kind,
                       default=None, metavar=metavar, help=text)
    w.add_argument("--replay", type=Path, metavar="FILE",
                   help="JSON/JSONL per-request records (request_traces rows work)")
    w.add_argument("--replay-step-ms", type=float, default=20.0, metavar="MS",
                   help="milliseconds per scheduler step, to turn arrival seconds into "
                   "steps (20)")
    o = p.add_argument_group("output")
    o.add_argument("--format", choices=sorted(RENDERERS), default="table",
                   help="table (settings as columns), json, or csv (a row per setting)")
    o.add_argument("--png", type=Path, metavar="FILE", help="also draw bar charts")
    o.add_argument("--max-steps", type=int, default=1_000_000, metavar="N",
                   help="stop a setting's run after this many steps (1000000)")
    o.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


@dataclass(frozen=True)
class Plan:
    settings: list[Setting]
    requests: list[TwinRequest]
    workload: str
    notes: list[str]


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def _synthetic(args: argparse.Namespace, errors: list[str]) -> Plan | None:
    given: dict[str, Any] = {}
    ok = True
    for name, (flag, kind, _) in _MIX.items():
        text = getattr(args, f"mix_{name}")
        if text is None:
            continue
        try:
            given[name] = _range(text) if kind == "range" else text
        except ValueError:
            errors.append(f"{flag}: {text!r} is not LOW:HIGH")
            ok = False
    n = WorkloadSpec.n_requests if args.requests is None else args.requests
    spec = replace(WorkloadSpec(), n_requests=n, seed=args.seed, **given)
    problems = spec.validate()
    errors += [f"workload: {e}" for e in problems]
    if problems or not ok:
        return None
    requests = generate(spec)
    too_long = sum(len(r.prompt_token_ids) >= args.max_model_len for r in requests)
    if too_long:
        errors.append(f"workload: {too_long} prompts reach --max-model-len "
                      f"{args.max_model_len}; shorten them or raise it")
        return None
    text = (f"synthetic mix, {n} requests, seed {spec.seed}: "
            f"{spec.short_fraction:.0%} short prompts {_span(spec.short_prompt)} tokens, long "
            f"{_span(spec.long_prompt)} (+{spec.shared_prefix_len}-token shared prefix on "
            f"{spec.shared_prefix_fraction:.0%}), output {_span(spec.max_tokens)}, "
            f"{spec.waves} waves {spec.wave_interval_steps} steps apart")
    return Plan([], requests, text, [])


def _span(r: tuple[int, int]) -> str:
    return f"{r[0]}-{r[1]}"


def plan(args: argparse.Namespace) -> tuple[Plan | None, list[str]]:
    """Settings and requests from parsed arguments, or every problem found."""
    errors: list[str] = []
    bpt = args.bytes_per_token or tiny_model_bytes_per_token()
    if args.bytes_per_token is not None and args.bytes_per_token < 1:
        errors.append("--bytes-per-token must be positive")
    axes = {k: [v.strip() for v in (getattr(args, f"axis_{k}") or "").split(",") if v.strip()]
            for k in KEYS}
    settings = build(axes, args.setting, max_model_len=args.max_model_len,
                     bytes_per_token=bpt, errors=errors)
    work: Plan | None = None
    if args.requests is not None and args.requests < 1:
        errors.append("--requests must be at least 1")
    elif args.replay is not None:
        mixed = [flag for name, (flag, _, _) in _MIX.items() if getattr(args, f"mix_{name}")]
        if mixed:
            errors.append(f"{', '.join(mixed)}: mix flags do not apply to --replay")
        if args.replay_step_ms <= 0:
            errors.append("--replay-step-ms must be positive")
        else:
            try:
                r = load(args.replay, seed=args.seed, step_ms=args.replay_step_ms,
                         max_model_len=args.max_model_len, limit=args.requests)
                work = Plan([], r.requests, f"replay of {args.replay.name}, "
                            f"{len(r.requests)} requests, seed {args.seed}", r.notes)
            except ReplayError as exc:
                errors += [f"--replay {args.replay}: {e}" for e in exc.errors]
    else:
        work = _synthetic(args, errors)
    if args.max_steps < 1:
        errors.append("--max-steps must be at least 1")
    if args.png is not None and not args.png.parent.is_dir():
        errors.append(f"--png: directory {args.png.parent} does not exist")
    if errors or work is None:
        return None, errors
    odd = sorted({s.config.block_size for s in settings if s.config.block_size % 32})
    notes = [f"block size {', '.join(map(str, odd))} runs in the twin (no attention); vLLM's "
             "CPU backend needs multiples of 32, CUDA backends take multiples of 16"] if odd else []
    return replace(work, settings=settings, notes=work.notes + notes), []


_CLEAR = "\r\033[K"  # carriage return, erase to the end of the line


class Progress:
    """Per setting: one line rewritten in place on a terminal, a final line otherwise."""

    def __init__(self, total: int, stream: Any = None, quiet: bool = False) -> None:
        self.total, self.quiet = total, quiet
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.index, self.name, self.last = 0, "", 0.0

    def start(self, index: int, name: str) -> None:
        self.index, self.name, self.last = index, name, time.monotonic()

    def step(self, steps: int, preemptions: int) -> None:
        now = time.monotonic()
        if self.quiet or not self.tty or now - self.last < 0.25:
            return
        self.last = now
        self.stream.write(f"{_CLEAR}[{self.index}/{self.total}] {self.name}: step {steps}, "
                          f"{preemptions} preemptions")
        self.stream.flush()

    def done(self, m: Measurement) -> None:
        if not self.quiet:
            self.stream.write((_CLEAR if self.tty else "") + f"[{self.index}/{self.total}] "
                              f"{self.name}: {m.steps} steps, {m.preemptions_total} "
                              f"preemptions, {m.wall_seconds:.1f} s\n")
            self.stream.flush()


def compare(p: Plan, *, seed: int, max_steps: int | None = None,
            progress: Progress | None = None) -> Report:
    """Measure every setting of ``p`` on its requests."""
    columns = []
    for i, setting in enumerate(p.settings, 1):
        if progress:
            progress.start(i, setting.name)
        m = measure(setting.config, p.requests, seed=seed, max_steps=max_steps,
                    on_step=progress.step if progress else None)
        if progress:
            progress.done(m)
        columns.append((setting, m))
    return Report(p.workload, columns, p.notes)


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
    progress = Progress(len(work.settings), quiet=args.quiet)
    if not args.quiet:
        print(f"{len(work.settings)} settings x {len(work.requests)} requests; loading "
              "vLLM's scheduler...", file=sys.stderr, flush=True)
    try:
        refused = refusals(work.settings)
        if refused:
            print("kvscope whatif: vLLM refuses these settings:\n  - " + "\n  - ".join(refused),
                  file=sys.stderr)
            return 2
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

