"""Code run in a fresh interpreter, for what a test's own process has already done: imported
every module, or would be changed by it (its garbage collector)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def last_json_line(code: str, timeout_s: float = 120.0) -> Any:
    """Run ``code`` with only kvscope's sources on the path; its last line of output, read
    as JSON (a failure of the code fails the test with its error)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout_s, cwd=ROOT,
                         env={"PYTHONPATH": f"{ROOT / 'exporter'}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])
