"""Command line: ``kvscope serve`` (the sidecar), ``kvscope demo`` (the embedded default) and
the tools around them; each command is a module of ``COMMANDS``."""

from __future__ import annotations

import argparse
import sys

from kvscope import __version__
from kvscope.commands import demo, serve
from kvscope.explain import cli as explain
from kvscope.layout import dump as layout_dump
from kvscope.load import cli as loadgen
from kvscope.store import query, schema
from kvscope.whatif import cli as whatif

COMMANDS = (serve, demo, whatif, loadgen, layout_dump, query, schema, explain)
"""Each has ``add_parser(subparsers)`` (which sets ``run``) and ``run(args) -> int``."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
