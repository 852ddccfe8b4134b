"""``ast.parse`` for tests that read kvscope's own source."""

from __future__ import annotations

import ast
from pathlib import Path

PARSE_TRIES = 3


def parse(path: Path) -> ast.Module:
    """``ast.parse`` of one file. CPython 3.11 before 3.11.8 counts the AST constructor's
    depth in state shared by every thread, so a parse or compile in another thread of this
    process (an earlier test's thread, under pytest-xdist) can make a correct parse raise
    ``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905; seen
    in CI's workers, in test_layers and test_metric_table). The file is the same: parse it
    again, a bounded number of times."""
    source = path.read_text()
    for attempt in range(PARSE_TRIES):
        try:
            return ast.parse(source, str(path))
        except SystemError:
            if attempt == PARSE_TRIES - 1:
                raise
    raise AssertionError("unreachable")
