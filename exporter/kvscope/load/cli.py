"""``kvscope loadgen``: a bounded, seeded mix of completions against an OpenAI-compatible server.

Sends exactly ``--requests`` completions (``kvscope.load.mix``: mostly short prompts,
some long ones, half of those sharing a prefix, ``ignore_eos`` so ``max_tokens`` fixes each
output), at most ``--concurrency`` at once, then prints ok / errors, latency p50 / p99 and
tokens per second. ``--client-id``, ``--user-agent`` and ``--api-key`` set what kvscope's
client middleware records, so a run shows up under that client. Only loopback servers
are loaded unless ``--allow-remote`` is given.

  kvscope loadgen --requests 120 --concurrency 32
  kvscope loadgen --url http://127.0.0.1:8000 --client-id batch-a --priority 0:3
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import time
from typing import Any, TextIO
from urllib.parse import urlsplit

from kvscope import __version__
from kvscope.load.mix import (
    DEFAULT_BASE_URL,
    LoadResult,
    LoadSpec,
    RequestOutcome,
    run_load_sync,
)

ENV = {"url": "KVSCOPE_LOADGEN_URL", "client_id": "KVSCOPE_LOADGEN_CLIENT_ID",
       "client_id_header": "KVSCOPE_CLIENT_ID_HEADER", "api_key": "KVSCOPE_LOADGEN_API_KEY"}
_RANGES = {"max_tokens": "32:256", "short_words": "8:48", "long_words": "300:700"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``loadgen`` to a ``kvscope`` subparsers object."""
    env = os.environ.get
    p = subparsers.add_parser(
        "loadgen", help="a bounded mixed load against an OpenAI-compatible endpoint",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=env(ENV["url"], DEFAULT_BASE_URL), metavar="URL",
                   help=f"server base URL (default {DEFAULT_BASE_URL}) [{ENV['url']}]")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a server that is not on this host's loopback")
    p.add_argument("--requests", type=int, default=120, metavar="N",
                   help="completions to send, exactly (120)")
    p.add_argument("--concurrency", type=int, default=32, metavar="N",
                   help="most requests in flight at once (32)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="the mix; X-Request-Id is kvs-SEED-INDEX (0)")
    p.add_argument("--model", default="tiny", metavar="NAME",
                   help="served model name (tiny)")
    for name, default in _RANGES.items():
        p.add_argument("--" + name.replace("_", "-"), default=default, metavar="LOW:HIGH",
                       help=f"{name.replace('_', ' ')} range (default {default})")
    p.add_argument("--short-fraction", type=float, default=0.7, metavar="FRACTION",
                   help="share of short prompts (0.7)")
    p.add_argument("--shared-prefix-fraction", type=float, default=0.5, metavar="FRACTION",
                   help="share of long prompts starting with the shared prefix (0.5)")
    p.add_argument("--shared-prefix-words", type=int, default=256, metavar="N",
                   help="words (one token each in the tiny model) in that prefix (256)")
    p.add_argument("--priority", metavar="LOW:HIGH",
                   help="random per-request priority (vLLM --scheduling-policy priority)")
    p.add_argument("--client-id", default=env(ENV["client_id"]), metavar="ID",
                   help=f"sent in the client-id header [{ENV['client_id']}]")
    p.add_argument("--client-id-header", default=env(ENV["client_id_header"], "X-Client-Id"),
                   metavar="NAME",
                   help=f"header name the middleware reads [{ENV['client_id_header']}]")
    p.add_argument("--user-agent", default=f"kvscope-loadgen/{__version__}", metavar="UA",
                   help=f"User-Agent header (kvscope-loadgen/{__version__})")
    p.add_argument("--api-key", default=env(ENV["api_key"]), metavar="KEY",
                   help=f"sent as Authorization: Bearer [{ENV['api_key']}]")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'",
                   help="extra header, repeatable")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="deadline for the whole load in seconds (600)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="summary as text or JSON, on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=run)
    return p


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; no name is resolved."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _range(flag: str, text: str | None, errors: list[str]) -> tuple[int, int] | None:
    if text is None:
        return None
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        errors.append(f"{flag}: {text!r} is not LOW:HIGH")
        return None


def headers(args: argparse.Namespace, errors: list[str]) -> dict[str, str]:
    """The headers every request carries; what HTTP cannot send is an argument error,
    before any request (it failed each request inside the load, which then read as cut
    off by the deadline, and h11's message quoted the value: the API key among them)."""
    out = {"User-Agent": args.user_agent}
    flags = {"User-Agent": "--user-agent"}
    if args.client_id:
        out[args.client_id_header] = args.client_id
        flags[args.client_id_header] = "--client-id"
    if args.api_key:
        out["Authorization"] = f"Bearer {args.api_key}"
        flags["Authorization"] = "--api-key"
    for text in args.header:
        name, sep, value = text.partition(":")
        if not sep or not name.strip():
            errors.append(f"--header: {text!r} is not 'NAME: VALUE'")
        else:
            out[name.strip()] = value.strip()
            flags[name.strip()] = "--header"
    for name, value in out.items():
        if not _sendable(name, value):
            errors.append(f"{flags[name]}: the {name} header must be printable ASCII "
                          "(no control characters)")
    return out


def _sendable(name: str, value: str) -> bool:
    """Whether HTTP/1.1 can carry this header: a token name, a printable ASCII value."""
    token = "!#$%&'*+-.^_`|~"
    return (bool(name) and all(c.isascii() and (c.isalnum() or c in token) for c in name)
            and all(c == "\t" or " " <= c <= "~" for c in value))


def plan(args: argparse.Namespace) -> tuple[LoadSpec | None, list[str]]:
    """The load to send, or every problem with the arguments."""
    errors: list[str] = []
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        errors.append(f"--url: {args.url!r} is not http(s)://host[:port]")
    elif not args.allow_remote and not is_loopback(parts.hostname):
        errors.append(f"--url: {parts.hostname} is not a loopback address; "
                      "pass --allow-remote to load another host")
    ranges = {name: _range("--" + name.replace("_", "-"), getattr(args, name), errors)
              for name in (*_RANGES, "priority")}
    sent = headers(args, errors)
    try:
        spec = LoadSpec(
            n_requests=args.requests, concurrency=args.concurrency, seed=args.seed,
            short_fraction=args.short_fraction, short_words=ranges["short_words"] or (8, 48),
            long_words=ranges["long_words"] or (300, 700),
            shared_prefix_fraction=args.shared_prefix_fraction,
            shared_prefix_words=max(0, args.shared_prefix_words),
            max_tokens=ranges["max_tokens"] or (32, 256), priority=ranges["priority"],
            model=args.model, timeout_s=args.timeout, headers=sent)
    except ValueError as exc:
        errors += str(exc).removeprefix("invalid LoadSpec: ").split("; ")
        spec = None
    if args.shared_prefix_words < 0:
        errors.append("--shared-prefix-words must not be negative")
    return (spec, errors) if not errors else (None, errors)


class Progress:
    """Completed requests: one line rewritten in place on a terminal, else a line every
    ``interval_s`` seconds; ``finish`` ends it."""

    def __init__(self, total: int, stream: TextIO | None = None, interval_s: float = 5.0,
                 tty: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.interval_s = total, (0.1 if self.tty else interval_s)
        self.done = self.errors = 0
        self.started = self.last = time.monotonic()

    def __call__(self, outcome: RequestOutcome) -> None:
        self.done += 1
        self.errors += not outcome.ok
        now = time.monotonic()
        if now - self.last >= self.interval_s or self.done == self.total:
            self.last = now
            self._write()

    def _write(self) -> None:
        line = (f"{self.done}/{self.total} done, {self.errors} errors, "
                f"{time.monotonic() - self.started:.1f} s")
        self.stream.write(f"\r{line}" if self.tty else f"{line}\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def summary_lines(result: LoadResult) -> list[str]:
    lines = [
        f"requests   {result.requests} (ok {result.ok}, errors {result.error_count})",
        f"elapsed    {result.elapsed_s:.2f} s",
        f"latency    p50 {result.latency_p50_s:.3f} s, p99 {result.latency_p99_s:.3f} s, "
        f"max {result.latency_max_s:.3f} s (successful requests)",
        f"tokens     prompt {result.prompt_tokens}, completion {result.completion_tokens}, "
        f"{result.completion_tokens_per_s:.1f} completion tokens/s",
    ]
    if result.errors:
        lines.append(f"first errors ({len(result.errors)} of {result.error_count}):")
        lines += [f"  {e}" for e in result.errors]
    return lines


def run(args: argparse.Namespace) -> int:
    """``kvscope loadgen``: 0 when every request succeeded, 1 when some failed, 2 on bad
    arguments."""
    spec, errors = plan(args)
    if spec is None:
        print("kvscope loadgen: invalid arguments:\n  - " + "\n  - ".join(errors),
              file=sys.stderr)
        return 2
    progress = None if args.quiet else Progress(spec.n_requests)
    if progress:
        print(f"loadgen: {spec.n_requests} requests to {args.url}, concurrency "
              f"{spec.concurrency}, seed {spec.seed}", file=sys.stderr, flush=True)
    result = run_load_sync(args.url.rstrip("/"), spec, on_done=progress)
    if progress:
        progress.finish()
    if args.format == "json":
        print(json.dumps({"url": args.url, **result.summary()}, indent=2))
    else:
        print("\n".join(summary_lines(result)))
    return 0 if result.error_count == 0 else 1
