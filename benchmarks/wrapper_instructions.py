"""Instructions one ``BlockPool.get_new_blocks`` wrapper call costs, this checkout against
others, counted exactly by cachegrind (every thread, no timing noise).

    .venv/bin/python benchmarks/wrapper_instructions.py --against /tmp/old/exporter

Each tree's probe wraps a stand-in pool (the same stand-in ``calibrate.py`` measures); a run
of N calls minus a run of none, divided by N, is the wrapper call with the stand-in's own
body and the loop included (the same in every tree, so differences are the wrapper's).
``--against`` takes an ``exporter`` directory of another checkout (``git archive REV
exporter | tar x``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOOP = """
import sys
from types import SimpleNamespace
from kvscope_probe import hooks

class Pool:
    ret = [SimpleNamespace(block_id=1)]
    def get_new_blocks(self, num_blocks): return self.ret
    def touch(self, blocks): ...
    def free_blocks(self, ordered_blocks): ...
    def unpin_blocks(self, blocks, on_reuse=None): ...

try:
    hooks._pool_hooks(Pool, registry={})  # not vLLM's: kept out of the probe's registry
except TypeError:  # a probe from before the registry
    hooks._pool_hooks(Pool)
pool = Pool()
rec = SimpleNamespace(enabled=True, ops=[], allocs=0, wrap_ns=0)
pool._kvscope = rec
call = pool.get_new_blocks
for _ in range(int(sys.argv[1])):
    call(1)
    rec.ops.clear()
"""


def instructions(tree: Path, calls: int, script: Path) -> int:
    out = Path(tempfile.mkstemp(suffix=".cg")[1])
    try:
        subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                        f"--cachegrind-out-file={out}", sys.executable, str(script),
                        str(calls)], check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(tree)})
        line = next(t for t in out.read_text().splitlines() if t.startswith("summary:"))
        return int(line.split()[1])
    finally:
        out.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--against", action="append", default=[], metavar="EXPORTER_DIR")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "loop.py"
        script.write_text(LOOP)
        for tree in [HERE.parent / "exporter", *map(Path, args.against)]:
            per_call = (instructions(tree, args.calls, script)
                        - instructions(tree, 0, script)) / args.calls
            print(f"{per_call:10.0f} instructions a call  {tree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
