"""What starting `kvscope` (and so `kvscope serve`, the sidecar) imports: never vLLM or
torch. A sidecar image need not hold vLLM, and importing it costs the sidecar torch's
memory and threads beside the engines it watches: the demo's sidecar, slowed by them,
let its probe drop records."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_and_the_sidecar_import_neither_vllm_nor_torch() -> None:
    code = ("import sys, kvscope.cli, kvscope.sidecar.server; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
