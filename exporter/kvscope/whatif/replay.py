"""Workloads replayed from stored per-request records, for ``kvscope whatif --replay``.

A replay file is JSON (a list of records, or ``{"requests": [...]}``) or JSON Lines (one
record per line; ClickHouse ``FORMAT JSONEachRow`` writes this). Each record is an
object; unknown keys are ignored, so rows exported from kvscope's ``request_traces``
table replay as they are. Recognised keys:

- ``prompt_len`` (required, int >= 1): prompt tokens, shared prefix included.
- ``output_len`` (int >= 1), else ``max_tokens`` or ``max_gen_len`` (int >= 1): output
  tokens. The twin ignores EOS, so this is exactly what the request generates; a traced
  ``output_len`` of 0 (aborted before its first token) replays with one output token,
  vLLM's least ``max_tokens``, and the notes count such requests.
- arrival, one clock per file: ``arrival_step`` (int >= 0, scheduler steps),
  ``arrival_s`` (seconds, any origin) or ``arrival_ts`` (epoch seconds, or a
  ``YYYY-MM-DD hh:mm:ss[.fff]`` UTC time as ClickHouse prints ``DateTime64``). Seconds
  become steps at ``step_ms`` per step, counted from the earliest arrival. No arrival
  key: every request arrives at step 0.
- ``prefix_group`` (string or int) with ``prefix_len`` (1 <= prefix_len <= prompt_len):
  requests of one group start with the same first ``prefix_len`` tokens.
- ``priority`` (int, default 0; lower is served first under the priority policy).
- outcomes, as the saved query ``replay_traffic`` writes them: ``preempt_count``,
  ``recomputed_tokens``, ``admitted_step``, ``min_free_blocks`` (integers >= 0, quoted
  or not, as are ``finished_step`` and ``cached_tokens``; null: unknown). A file with all four is
  a recorded run: ``--baseline`` checks the twin against it (``kvscope.whatif.recorded``).
  Records of one step replay in file order, which ``replay_traffic`` makes vLLM's queue
  order; ``engine`` (optional) must be one value per file.
- ``session`` with ``session_start``, and ``step_counter`` with ``step_counter_start`` (as
  ``replay_traffic`` writes them): the probe session (one life of the engine) and the
  sidecar's count of its steps (they count from 1 again after a sidecar restart) each
  request arrived in; a file of several is refused with the window on either side of each
  restart (``kvscope.whatif.window``).
- ``left_out_started_before``, ``left_out_not_ended`` and ``left_out_not_queued``
  (``replay_traffic``'s, one count on every record): requests of the engine that ran
  across the window's edges, or were traced in it with no ``queued`` row stored, and are
  not in it; the notes count them.

Prompts are synthetic token IDs of the recorded lengths, drawn from ``seed``: kvscope never
stores prompt text or tokens. Shared prefixes survive only where the file names them;
``request_traces`` rows cannot say which requests shared a prefix (``cached_tokens`` says
a hit happened, not with whom), so their replay has no prefix-cache hits between requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscope.times import epoch_seconds
from kvscope.twin.workload import TOKEN_ID_MAX, TOKEN_ID_MIN, TwinRequest
from kvscope.whatif.window import left_out, left_out_note, lives, restart_error

MAX_ERRORS_SHOWN = 20
_CLOCKS = ("arrival_step", "arrival_s", "arrival_ts")
COUNT_KEYS = ("admitted_step", "finished_step", "preempt_count", "recomputed_tokens",
              "min_free_blocks", "cached_tokens")
"""Integer keys kept for ``kvscope.whatif.recorded`` and the recorded client, converted
to int on load: ClickHouse's JSONEachRow quotes 64-bit integers (``"9"``), and a quoted
step compared with an int one fails (``arrival_step`` is converted as the arrival)."""


class ReplayError(ValueError):
    """Every problem found in one replay file."""

    def __init__(self, errors: list[str]) -> None:
        shown = errors[:MAX_ERRORS_SHOWN]
        if len(errors) > MAX_ERRORS_SHOWN:
            shown.append(f"... and {len(errors) - MAX_ERRORS_SHOWN} more")
        super().__init__("; ".join(shown))
        self.errors = shown


@dataclass(frozen=True)
class Replay:
    requests: list[TwinRequest]
    notes: list[str]
    """What the replay could not reproduce, one sentence each."""
    records: list[dict[str, Any]]
    """The records replayed, in replay order (``requests[i]`` from ``records[i]``)."""
    left_out: dict[str, int] | None = None
    """Requests of the engine the stored window left out
    (``kvscope.whatif.window.left_out``); None when the file does not say."""


def read_records(path: Path, errors: list[str]) -> list[dict[str, Any]]:
    """The object records of a JSON or JSON Lines file; the rest reported in ``errors``."""
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("requests"), list):
        data = data["requests"]
    found: list[tuple[str, Any]] = []
    if isinstance(data, list):
        found = [(f"record {i}", r) for i, r in enumerate(data, 1)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    found.append((f"line {n}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    errors.append(f"line {n}: not JSON ({exc.msg})")
    errors += [f"{where}: not an object" for where, r in found if not isinstance(r, dict)]
    return [dict(r, _where=where) for where, r in found if isinstance(r, dict)]


def _int(rec: dict[str, Any], key: str, least: int, errors: list[str]) -> int | None:
    value = rec.get(key)
    if value is None:
        return None
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        errors.append(f"{rec['_where']}: {key} must be an integer, got {value!r}")
        return None
    if number != float(value) or number < least:
        errors.append(f"{rec['_where']}: {key} must be an integer >= {least}, got {value!r}")
        return None
    return number


def _seconds(rec: dict[str, Any], key: str, errors: list[str]) -> float | None:
    value = rec[key]
    try:
        return epoch_seconds(value)
    except ValueError:
        errors.append(f"{rec['_where']}: {key} must be seconds or a date-time, got {value!r}")
        return None


def _arrivals(records: list[dict[str, Any]], step_ms: float, errors: list[str]) -> list[int]:
    clocks = {k for r in records for k in _CLOCKS if r.get(k) is not None}
    if len(clocks) > 1:
        errors.append(f"use one arrival clock per file, found {', '.join(sorted(clocks))}")
    if len(clocks) != 1:
        return [0] * len(records)
    clock = clocks.pop()
    values = [_arrival(r, clock, errors) for r in records]
    if clock == "arrival_step":
        return [int(v or 0) for v in values]
    origin = min((v for v in values if v is not None), default=0.0)
    return [0 if v is None else round((v - origin) * 1000.0 / step_ms) for v in values]


def _arrival(rec: dict[str, Any], clock: str, errors: list[str]) -> float | None:
    if rec.get(clock) is None:
        errors.append(f"{rec['_where']}: {clock} missing (other records have it)")
        return None
    if clock == "arrival_step":
        return _int(rec, clock, 0, errors)
    return _seconds(rec, clock, errors)


ABORTED_OUTPUT = 1
"""Output tokens a request aborted before its first token (a traced ``output_len`` of 0)
replays with: vLLM's least ``max_tokens``. It ran no further; its ``max_gen_len`` (what
the engine would have allowed, often max_model_len - prompt) would run it to full
context in the twin and preempt what the server never preempted."""


def _output_len(rec: dict[str, Any], errors: list[str]) -> int | None:
    out = _int(rec, "output_len", 0, errors)
    if out:
        return out
    if out == 0:
        return ABORTED_OUTPUT
    for key in ("max_tokens", "max_gen_len"):
        limit = _int(rec, key, 1, errors)
        if limit is not None:
            return limit
    errors.append(f"{rec['_where']}: needs output_len, max_tokens or max_gen_len")
    return None


def load(path: Path, *, seed: int, step_ms: float, max_model_len: int,
         limit: int | None = None) -> Replay:
    """The twin requests ``path`` describes; raises ReplayError listing every problem."""
    errors: list[str] = []
    try:
        records = read_records(path, errors)
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError([f"cannot read it: {exc}"]) from None
    if not records and not errors:
        errors.append("no records")
    arrivals = _arrivals(records, step_ms, errors)
    order = sorted(range(len(records)), key=lambda i: (arrivals[i], i))[:limit]
    rng = random.Random(seed)
    prefixes: dict[str, list[int]] = {}
    requests: list[TwinRequest] = []
    kept: list[dict[str, Any]] = []
    aborted = 0  # replayed with ABORTED_OUTPUT tokens
    for i in order:
        rec = records[i]
        prompt = _int(rec, "prompt_len", 1, errors)
        output = _output_len(rec, errors)
        priority = _int(rec, "priority", -(2**31), errors) or 0
        prefix = _prefix(rec, prompt, errors)
        counts = _counts(rec, errors)
        if prompt is None or output is None or counts is None:
            continue
        if prompt >= max_model_len:
            errors.append(f"{rec['_where']}: prompt_len {prompt} leaves no room for output "
                          f"within max_model_len {max_model_len}")
            continue
        tokens: list[int] = []
        if prefix is not None:
            group, n = prefix
            shared = prefixes.setdefault(group, [])
            shared.extend(_tokens(rng, n - len(shared)))
            tokens = shared[:n]
        tokens += _tokens(rng, prompt - len(tokens))
        requests.append(TwinRequest(f"q{len(requests)}", tuple(tokens), output, priority,
                                    arrivals[i]))
        aborted += _int(rec, "output_len", 0, []) == 0
        kept.append({k: v for k, v in rec.items() if k != "_where"} | counts
                    | {"arrival_step": arrivals[i], "priority": priority})
    engines = {str(r["engine"]) for r in records if r.get("engine") not in (None, "")}
    if len(engines) > 1:
        errors.append(f"records of {len(engines)} engines ({', '.join(sorted(engines))}): "
                      "steps count per engine, replay one (replay_traffic --param engine=)")
    restarted = restart_error(lives(records, errors))
    if restarted:
        errors.append(restarted)
    edges = left_out(records, errors)
    if errors:
        raise ReplayError(errors)
    notes = _notes(records, requests, max_model_len, aborted)
    said = left_out_note(edges)
    return Replay(requests, notes + ([said] if said else []), kept, edges)


def _counts(rec: dict[str, Any], errors: list[str]) -> dict[str, int | None] | None:
    """``COUNT_KEYS`` of ``rec`` as ints (null: None), None after reporting any that is
    not an integer >= 0."""
    before = len(errors)
    got = {k: _int(rec, k, 0, errors) for k in COUNT_KEYS if k in rec}
    return got if len(errors) == before else None


def _prefix(rec: dict[str, Any], prompt: int | None,
            errors: list[str]) -> tuple[str, int] | None:
    group = rec.get("prefix_group")
    if group is None or group == "":
        return None
    n = _int(rec, "prefix_len", 1, errors)
    if n is None:
        if rec.get("prefix_len") is None:
            errors.append(f"{rec['_where']}: prefix_group needs prefix_len")
        return None
    if prompt is not None and n > prompt:
        errors.append(f"{rec['_where']}: prefix_len {n} exceeds prompt_len {prompt}")
        return None
    return str(group), n


def _notes(records: list[dict[str, Any]], requests: list[TwinRequest],
           max_model_len: int, aborted: int) -> list[str]:
    notes = ["prompts are synthetic token IDs of the recorded lengths (kvscope stores no "
             "prompt text)"]
    if not any(r.get("prefix_group") not in (None, "") for r in records):
        hits = sum(isinstance(v := r.get("cached_tokens"), (int, float)) and v > 0
                   for r in records)
        notes.append("no prefix groups in the file: shared prefixes cannot be reconstructed "
                     "from traces, so replayed requests share no prefix-cache blocks"
                     + (f"; {hits} recorded requests had prefix-cache hits, where the replay "
                        "may part from the server" if hits else ""))
    if aborted:
        notes.append(f"{aborted} request{'s' if aborted > 1 else ''} aborted before "
                     f"{'their' if aborted > 1 else 'its'} first token (output_len 0) "
                     f"replayed with {ABORTED_OUTPUT} output token (vLLM's least max_tokens), "
                     f"not {'their' if aborted > 1 else 'its'} max_gen_len")
    capped = sum(1 for r in requests
                 if len(r.prompt_token_ids) + r.max_tokens > max_model_len)
    if capped:
        notes.append(f"{capped} requests' output capped to fit max_model_len {max_model_len}")
    return notes


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_ID_MIN, TOKEN_ID_MAX) for _ in range(max(0, n))]
