"""``kvscope layout dump``: save a sidecar's KV block layout as JSON (and a PNG heatmap).

The JSON follows ``kvscope/layout/layout.schema.json`` (``$defs/dump``): the
``/api/layout`` entry of each engine plus its recent timeline from
``/api/layout/history``. ``--pid`` takes any process of a vLLM server's tree (the API
server, an EngineCore, a worker) and picks the engines of that tree: an engine matches
when the PID is in the tree around its EngineCore (its topmost vLLM ancestor, usually the
API server, and everything below). It looks on ``--url``, ``$KVSCOPE_URL`` and the
default address. Run it where the vLLM processes are visible (same host and PID namespace);
elsewhere only the EngineCore's own PID matches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import httpx
import psutil

from kvscope.settings import BY_NAME, default

DEFAULT_URL = f"http://{default('host')}:{default('port')}"
"""Where ``kvscope serve`` listens by default (``kvscope.settings``)."""
TOKEN_ENV = BY_NAME["token"].env
FORMAT = "kvscope-layout-dump/1"


class DumpError(RuntimeError):
    pass


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``layout dump`` under the given subparsers (``kvscope layout dump ...``)."""
    layout = subparsers.add_parser("layout", help="the KV block layout of a running sidecar")
    sub = layout.add_subparsers(dest="layout_command", required=True)
    p = sub.add_parser("dump", help="save the layout as JSON, and optionally a PNG heatmap")
    p.add_argument("--output", "-o", required=True, help="JSON file to write ('-' for stdout)")
    p.add_argument("--png", help="also draw a heatmap PNG here (block ID x time)")
    p.add_argument("--url", default=os.environ.get("KVSCOPE_URL") or DEFAULT_URL,
                   help=f"sidecar base URL, default {DEFAULT_URL} [KVSCOPE_URL]")
    p.add_argument("--pid", type=int, help="only the engines of the vLLM server that has "
                   "this PID (API server, EngineCore or worker); looks on --url, "
                   "$KVSCOPE_URL and the default URL")
    p.add_argument("--engine", help="only this engine (its key, or its engine label)")
    p.add_argument("--history", type=float, default=600.0,
                   help="seconds of timeline to include (default 600; 0 for none)")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                   help=f"bearer token of the sidecar [{TOKEN_ENV}]")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds")
    p.set_defaults(run=run)
    return p


class SidecarClient:
    """A small HTTP client for one sidecar; use it in ``with``, which closes its
    connections (left to the collector, an open socket's finalizer warns, and a warning
    that runs inside an import breaks that import on CPython before 3.12: gh-91351)."""

    def __init__(self, url: str, token: str | None, timeout: float) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(headers=headers, timeout=timeout)

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(self.url + path, params={k: v for k, v in params.items()
                                                      if v is not None})
        if r.status_code == 401:
            raise DumpError(f"{self.url}: unauthorized (set --token or KVSCOPE_TOKEN)")
        if r.status_code >= 400:
            raise DumpError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:200]}")
        return r.json()


def _is_vllm(proc: psutil.Process) -> bool:
    try:
        return "vllm" in " ".join(proc.cmdline()).lower()
    except (psutil.Error, OSError):
        return False


def engine_tree(pid: int) -> set[int]:
    """The PIDs that count as the engine with EngineCore ``pid``: the tree under its
    topmost vLLM ancestor (API server, launcher), or just ``pid`` when that process is
    not visible here or is no vLLM process."""
    try:
        proc = psutil.Process(pid)
        root = proc
        for parent in proc.parents():  # nearest first
            if not _is_vllm(parent):
                break
            root = parent
        if root is proc and not _is_vllm(proc):
            return {pid}
        return {root.pid} | {c.pid for c in root.children(recursive=True)}
    except (psutil.Error, OSError):
        return {pid}


def find_by_pid(pid: int, urls: list[str], token: str | None, timeout: float
                ) -> tuple[str, list[str]]:
    """(sidecar URL, engine keys) of the engines whose vLLM process tree holds ``pid``."""
    seen: list[str] = []
    for url in urls:
        try:
            with SidecarClient(url, token, timeout) as side:
                engines = side.get("/api/engines")["engines"]
        except (httpx.HTTPError, DumpError, ValueError, KeyError) as exc:
            seen.append(f"{url}: {exc}")
            continue
        keys = [str(e.get("key", e["engine"])) for e in engines
                if isinstance(e.get("pid"), int) and pid in engine_tree(e["pid"])]
        if keys:
            return url, keys
        pids = ", ".join(f"engine {e.get('key', e.get('engine'))} pid {e.get('pid')}"
                         for e in engines)
        seen.append(f"{url}: {pids or 'no engine'}")
    raise DumpError(f"no sidecar serves a vLLM engine with pid {pid} in its process tree; "
                    "checked " + "; ".join(seen))


def collect(side: SidecarClient, engines: list[str] | None, history_s: float) -> dict[str, Any]:
    """The dump of these engines (keys or labels; None: every engine)."""
    bodies = [side.get("/api/layout", engine=e, max_runs=200_000) for e in engines or [None]]
    now = time.time()
    found = [e for b in bodies for e in b["engines"]]
    for e in found:
        if history_s > 0:
            e["timeline"] = side.get("/api/layout/history", engine=e.get("key", e["engine"]),
                                     since=now - history_s, until=now + 1)
    return {"format": FORMAT, "source": side.url, "taken_at": now,
            "interval_s": bodies[0].get("interval_s"), "engines": found}


def run(args: argparse.Namespace) -> int:
    url, engines = args.url, [args.engine] if args.engine else None
    try:
        if args.pid is not None:
            candidates = list(dict.fromkeys(
                [args.url, os.environ.get("KVSCOPE_URL") or DEFAULT_URL, DEFAULT_URL]))
            url, engines = find_by_pid(args.pid, candidates, args.token, args.timeout)
        with SidecarClient(url, args.token, args.timeout) as side:
            dump = collect(side, engines, args.history)
    except (httpx.HTTPError, DumpError) as exc:
        print(f"kvscope layout dump: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(dump, separators=(",", ":"))
    if args.output == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    samples = sum(len(e.get("timeline", {}).get("snapshots", [])) for e in dump["engines"])
    note = f"{len(dump['engines'])} engine(s), {samples} timeline samples, from {url}"
    if args.png:
        from kvscope.layout.png import render_png

        w, h = render_png(dump, args.png)
        note += f"; {args.png} ({w}x{h})"
    if args.output != "-":
        print(f"wrote {args.output}: {note}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvscope")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
