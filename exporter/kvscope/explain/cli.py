"""``kvscope explain``: why one request was slow, from the store alone.

Exit codes: 0 answered; 1 the store failed (unreachable, locked); 2 bad usage, a
``--counterfactual`` whose window the twin cannot replay as asked included (a prompt
longer than ``--max-model-len``); 3 no request with that ID is in the store.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvscope.store import schema
from kvscope.store.query import ENV_DSN, _connect, _explain, default_dsn
from kvscope.times import epoch_seconds

EXIT_UNKNOWN = 3


class BadUsage(ValueError):
    """What the user asked cannot be answered from this store as asked (exit 2): the
    message says what to change."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("explain", help="why was this request slow: its timeline, who "
                                              "held the pool, time lost (from the store)")
    p.add_argument("request_id", nargs="?", help="vLLM's request ID or the caller's "
                                                 "X-Request-Id")
    p.add_argument("--worst", type=int, metavar="N",
                   help="the N requests that lost the most time waiting or preempted")
    p.add_argument("--since", default="3600", help="with --worst: seconds back from now "
                   "(e.g. 3600), or an epoch / ISO 8601 time (default 3600)")
    p.add_argument("--server", default="", help="with --worst: one vLLM server")
    p.add_argument("--engine", default="", help="with --worst: one engine of it (as the "
                   "metrics' engine label)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--counterfactual", metavar="engine|KEY:VALUE,...",
                   help="replay the window around the request on the twin under the "
                        "server's settings, gate it, then alternatives: 'engine' for the "
                        "settings the engine's probe reported (stored in engine_configs), or "
                        "as kvscope whatif --baseline takes them (e.g. "
                        "blocks:6250,block_size:16,max_seqs:256,budget:8192)")
    p.add_argument("--window", type=float, default=60.0, metavar="S",
                   help="with --counterfactual: seconds of arrivals before the request (60)")
    p.add_argument("--model", metavar="NAME|PATH", help="with --counterfactual: the served "
                   "model's KV layout (as kvscope whatif --model)")
    p.add_argument("--max-model-len", type=int, default=1024, metavar="N",
                   help="with --counterfactual: the server's --max-model-len (1024)")
    p.add_argument("--png", metavar="PATH", help="also draw the answer to this PNG (for a "
                                                 "ticket)")
    p.add_argument("--dsn", help=f"http(s)://... or chdb:///path [{ENV_DSN}, else the "
                                 "embedded store kvscope serve uses by default]")
    p.add_argument("--database", help="database (default: the DSN's, else kvscope)")
    p.set_defaults(run=run)
    return p


def counterfactual_model(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--model``'s KV layout as the twin takes it; ``BadUsage`` when it cannot be read,
    or when a hand-given ``--counterfactual`` is not a setting: both said before the
    store is read, never inside an answer that exits 0."""
    from kvscope.explain.counterfactual import problems

    model = None
    if args.model:
        from kvscope.models.kv_layout import load
        from kvscope.twin.scheduler import model_fields

        try:
            model = model_fields(load(args.model))
        except (OSError, ValueError) as exc:  # the message names --model
            raise BadUsage(str(exc)) from None
    wrong = problems(args.counterfactual, max_model_len=args.max_model_len, model=model)
    if wrong:
        raise BadUsage("--counterfactual: " + "; ".join(wrong))
    return model


def add_counterfactual(client: Any, got: dict[str, Any], args: argparse.Namespace,
                       model: dict[str, Any] | None) -> None:
    """Each engine request's counterfactual under ``args`` (kept in the answer);
    ``BadUsage`` when the twin cannot replay a window as asked."""
    from kvscope.explain.counterfactual import ENGINE, counterfactual
    from kvscope.whatif.replay import ReplayError

    for r in got["engine_requests"]:
        ev = r["timeline"]
        try:
            r["counterfactual"] = counterfactual(
                client, r["engine"], r["server"], r["request_id"], queued_ts=ev[0]["ts"],
                end_ts=ev[-1]["ts"], baseline=args.counterfactual, window_s=args.window,
                model=model, max_model_len=args.max_model_len)
        except ReplayError as exc:  # the records as stored, against the options given
            hint = ("; give the server's --max-model-len" if args.counterfactual != ENGINE
                    and "max_model_len" in str(exc) else "")
            raise BadUsage(f"--counterfactual cannot replay the window around "
                           f"{r['request_id']}: {exc}{hint}") from None


def since_epoch(text: str, now: float) -> float:
    """A number below a year of seconds is a span back from ``now``; else a time."""
    value = epoch_seconds(text)
    return now - value if value < 366 * 86400 else value


def run(args: argparse.Namespace) -> int:
    import time

    from kvscope.explain import answer, render_json, render_text
    from kvscope.store.sink import Target

    if (args.worst is None) == (args.request_id is None):
        print("kvscope explain: give a REQUEST_ID or --worst N", file=sys.stderr)
        return 2
    if args.worst is not None and args.worst < 1:
        print("kvscope explain: --worst takes a count of 1 or more", file=sys.stderr)
        return 2
    try:
        since = since_epoch(args.since, time.time())
        target = Target.parse(args.dsn or default_dsn())
        model = counterfactual_model(args) if args.counterfactual else None
    except ValueError as exc:  # BadUsage included
        print(f"kvscope explain: {exc}", file=sys.stderr)
        return 2
    try:
        client = _connect(target, args.database or target.database or schema.DEFAULT_DATABASE)
    except Exception as exc:  # noqa: BLE001 - one clear line, credentials hidden
        print(f"kvscope explain: {_explain(exc, target)}", file=sys.stderr)
        return 1
    try:
        if args.worst is not None:
            found = answer.worst(client, args.worst, since, args.server, args.engine)
            out = (render_json.dumps(found) if args.format == "json"
                   else render_text.worst(found))
        else:
            got = answer.explain(client, args.request_id)
            if args.counterfactual:
                add_counterfactual(client, got, args, model)
            if args.png:
                from kvscope.explain.png import render_png

                render_png(got, args.png)
            out = (render_json.dumps(got) if args.format == "json"
                   else render_text.render(got))
    except answer.UnknownRequest:
        print(f"kvscope explain: no request {args.request_id!r} in the store (neither an "
              "engine request ID nor an API request's X-Request-Id)", file=sys.stderr)
        return EXIT_UNKNOWN
    except BadUsage as exc:
        print(f"kvscope explain: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001
        print(f"kvscope explain: {_explain(exc, target)}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(out)
    return 0
