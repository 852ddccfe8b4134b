"""What packing a step's two count columns would cost the probe, in instructions.

    python benchmarks/packed_columns.py [--running 256 128 32] [--loops 2000]

The probe hands msgspec vLLM's own lists: a step's computed tokens (``cached_computed``,
vLLM's list as it is) and its scheduled counts (``list(num_scheduled_tokens.values())``),
encoded as one msgpack integer each. A wire that packed them (32-bit little-endian, one
bytes value each: no Python integer per count for the sidecar to decode, store and free)
would build them on the engine thread with ``struct.pack``. Each variant runs in its own
process under ``valgrind --tool=cachegrind --cache-sim=no``, ``loops`` and ``2 x loops``
times; the difference per loop is the instructions one step's columns cost to build and
encode: ``lists`` (what the probe does), ``packed`` (both packed), ``computed`` and
``scheduled`` (one packed). Attribution for a design not taken (benchmarks/README.md,
"eleventh pass"); a report, never an assertion.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("lists", "packed", "computed", "scheduled")


def child(variant: str, n: int, loops: int) -> None:
    import msgspec

    computed = [1000 + 7 * i for i in range(n)]  # most counts above 255: not one byte
    nst = {f"req-{i:032d}": 1 for i in range(n)}
    fmt = struct.Struct(f"<{n}i")
    enc = msgspec.msgpack.Encoder()
    buf = bytearray()
    for _ in range(loops):
        a: object = fmt.pack(*computed) if variant in ("packed", "computed") else computed
        b: object = (fmt.pack(*nst.values()) if variant in ("packed", "scheduled")
                     else list(nst.values()))
        enc.encode_into([a, b], buf)


def count(variant: str, n: int, loops: int, work: Path) -> int:
    from instructions import VALGRIND, total_ir

    out = work / f"cg.{variant}.{n}.{loops}"
    subprocess.run([*VALGRIND, f"--cachegrind-out-file={out}", sys.executable, __file__,
                    "--child", variant, str(n), str(loops)],
                   env={**os.environ, "PYTHONHASHSEED": "0"}, check=True,
                   capture_output=True)
    return total_ir(out)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[256, 128, 32])
    p.add_argument("--loops", type=int, default=2000)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvscope-packed-"))
    print(f"{'running':>7} " + " ".join(f"{v:>10}" for v in VARIANTS) + "   (instructions a step)")
    for n in args.running:
        per = {v: (count(v, n, 2 * args.loops, work) - count(v, n, args.loops, work))
               / args.loops for v in VARIANTS}
        print(f"{n:>7} " + " ".join(f"{per[v]:>10,.0f}" for v in VARIANTS)
              + f"   packing both: +{per['packed'] - per['lists']:,.0f}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
