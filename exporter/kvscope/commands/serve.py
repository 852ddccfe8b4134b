"""``kvscope serve``: the sidecar, configured from ``kvscope.settings`` (flags over
``KVSCOPE_*`` variables over defaults)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from kvscope.errors import ConfigError
from kvscope.settings import add_flags
from kvscope.sidecar.config import from_sources


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    serve = subparsers.add_parser(
        "serve", help="run the sidecar: receive probe records, serve /metrics")
    add_flags(serve)
    serve.set_defaults(run=run)
    return serve


def run(args: argparse.Namespace) -> int:
    cli = {k: v for k, v in vars(args).items() if k not in ("command", "run")}
    try:
        cfg = from_sources(cli)
    except ConfigError as exc:
        print(f"kvscope serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvscope.sidecar.server import Sidecar

    try:
        Sidecar(cfg).run()
    except Exception as exc:  # noqa: BLE001 - a clear line, not a traceback
        print(f"kvscope serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
