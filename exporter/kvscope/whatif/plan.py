"""What ``kvscope whatif`` runs: the settings and the requests, from its arguments."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any

from kvscope.models.kv_layout import load as load_model
from kvscope.twin.workload import TwinRequest, WorkloadSpec, generate
from kvscope.whatif.recorded import OUTCOME_KEYS, has_outcomes
from kvscope.whatif.replay import ReplayError, load
from kvscope.whatif.settings import KEYS, Setting, build, tiny_model_bytes_per_token

# WorkloadSpec field -> (flag, type, help); ranges are LOW:HIGH.
MIX = {
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



@dataclass(frozen=True)
class Plan:
    settings: list[Setting]
    requests: list[TwinRequest]
    workload: str
    notes: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)
    """The replayed records (empty for a synthetic mix)."""
    baseline: Setting | None = None
    """The settings the recorded server ran with (``--baseline``)."""
    left_out: dict[str, int] | None = None
    """Requests the replayed window left out at its edges (None: a synthetic mix, or a
    file that does not say)."""


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def _synthetic(args: argparse.Namespace, errors: list[str]) -> Plan | None:
    given: dict[str, Any] = {}
    ok = True
    for name, (flag, kind, _) in MIX.items():
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


def _replayed(args: argparse.Namespace, errors: list[str]) -> Plan | None:
    mixed = [flag for name, (flag, _, _) in MIX.items() if getattr(args, f"mix_{name}")]
    if mixed:
        errors.append(f"{', '.join(mixed)}: mix flags do not apply to --replay")
    if args.replay_step_ms <= 0:
        errors.append("--replay-step-ms must be positive")
        return None
    try:
        r = load(args.replay, seed=args.seed, step_ms=args.replay_step_ms,
                 max_model_len=args.max_model_len, limit=args.requests)
    except ReplayError as exc:
        errors += [f"--replay {args.replay}: {e}" for e in exc.errors]
        return None
    notes = list(r.notes)
    if has_outcomes(r.records) and args.baseline is None:
        notes.append("the file records what the server did: give --baseline with the "
                     "server's settings to check the twin against it (the fidelity gate)")
    return Plan([], r.requests, f"replay of {args.replay.name}, {len(r.requests)} "
                f"requests, seed {args.seed}", notes, r.records, left_out=r.left_out)


def _baseline(args: argparse.Namespace, work: Plan | None, bpt: int,
              errors: list[str]) -> Setting | None:
    if args.baseline is None:
        return None
    if work is None or not has_outcomes(work.records):
        errors.append("--baseline needs --replay of a file that records what the server "
                      f"did (the saved query replay_traffic: {', '.join(OUTCOME_KEYS)})")
        return None
    found = build({k: [] for k in KEYS}, [f"server={args.baseline}"],
                  max_model_len=args.max_model_len, bytes_per_token=bpt, errors=errors,
                  model=model_fields(args))
    return found[0] if found else None


def model_fields(args: argparse.Namespace) -> dict[str, Any] | None:
    """The TwinConfig fields of ``--model`` (after ``plan`` loaded it), else None."""
    model = getattr(args, "model_layout", None)
    if not model:
        return None
    # imported here: the CLI (kvscope serve among its commands) must not import vLLM
    from kvscope.twin.scheduler import model_fields as twin_model_fields

    return twin_model_fields(model)


def plan(args: argparse.Namespace) -> tuple[Plan | None, list[str]]:
    """Settings and requests from parsed arguments, or every problem found."""
    errors: list[str] = []
    try:
        model = load_model(args.model) if getattr(args, "model", None) else None
    except ValueError as exc:
        return None, [str(exc)]
    args.model_layout = model
    bpt = args.bytes_per_token or (model.bytes_per_token() if model
                                   else tiny_model_bytes_per_token())
    if args.bytes_per_token is not None and args.bytes_per_token < 1:
        errors.append("--bytes-per-token must be positive")
    axes = {k: [v.strip() for v in (getattr(args, f"axis_{k}") or "").split(",") if v.strip()]
            for k in KEYS}
    settings = build(axes, args.setting, max_model_len=args.max_model_len,
                     bytes_per_token=bpt, errors=errors, model=model_fields(args))
    work: Plan | None = None
    if args.requests is not None and args.requests < 1:
        errors.append("--requests must be at least 1")
    elif args.replay is not None:
        work = _replayed(args, errors)
    else:
        work = _synthetic(args, errors)
    baseline = _baseline(args, work, bpt, errors)
    if args.max_steps < 1:
        errors.append("--max-steps must be at least 1")
    if args.safe_concurrency and args.png is not None:
        errors.append("--png draws the comparison; --safe-concurrency has no chart")
    if args.png is not None and not args.png.parent.is_dir():
        errors.append(f"--png: directory {args.png.parent} does not exist")
    if errors or work is None:
        return None, errors
    notes: list[str] = []
    if model is not None and model.read_by.startswith("as written"):
        notes.append(f"--model {args.model}: config.json read {model.read_by}; the defaults "
                     "vLLM's loader gives what the file leaves out were not applied")
    odd = sorted({s.config.block_size for s in settings if s.config.block_size % 32})
    if odd:
        notes.append(f"block size {', '.join(map(str, odd))} runs in the twin (no attention); "
                     "vLLM's CPU backend needs multiples of 32, CUDA backends take multiples "
                     "of 16")
    return replace(work, settings=settings, notes=work.notes + notes, baseline=baseline), []
