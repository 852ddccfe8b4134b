"""``kvscope explain``: why one request was slow, from the store alone.

Exit codes: 0 answered; 1 the store failed (unreachable, locked); 2 bad usage;
3 no request with that ID is in the store.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvscope.store import schema
from kvscope.store.query import ENV_DSN, _connect, _explain, default_dsn
from kvscope.times import epoch_seconds

EXIT_UNKNOWN = 3


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
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--png", metavar="PATH", help="also draw the answer to this PNG (for a "
                                                 "ticket)")
    p.add_argument("--dsn", help=f"http(s)://... or chdb:///path [{ENV_DSN}, else the "
                                 "embedded store kvscope serve uses by default]")
    p.add_argument("--database", help="database (default: the DSN's, else kvscope)")
    p.set_defaults(func=run)
    return p


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
    try:
        since = since_epoch(args.since, time.time())
        target = Target.parse(args.dsn or default_dsn())
    except ValueError as exc:
        print(f"kvscope explain: {exc}", file=sys.stderr)
        return 2
    try:
        client = _connect(target, args.database or target.database or schema.DEFAULT_DATABASE)
    except Exception as exc:  # noqa: BLE001 - one clear line, credentials hidden
        print(f"kvscope explain: {_explain(exc, target)}", file=sys.stderr)
        return 1
    try:
        if args.worst is not None:
            found = answer.worst(client, args.worst, since, args.server)
            out = (render_json.dumps(found) if args.format == "json"
                   else render_text.worst(found))
        else:
            got = answer.explain(client, args.request_id)
            if args.png:
                from kvscope.explain.png import render_png

                render_png(got, args.png)
            out = (render_json.dumps(got) if args.format == "json"
                   else render_text.render(got))
    except answer.UnknownRequest:
        print(f"kvscope explain: no request {args.request_id!r} in the store (neither an "
              "engine request ID nor an API request's X-Request-Id)", file=sys.stderr)
        return EXIT_UNKNOWN
    except Exception as exc:  # noqa: BLE001
        print(f"kvscope explain: {_explain(exc, target)}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(out)
    return 0
