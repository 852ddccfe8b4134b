"""The ledger checked against vLLM's own pool, slice by slice (``wire.Audit``).

One step in ``kvscope_probe.mirror.AUDIT_EVERY`` (8) the probe reads a slice of vLLM's
``BlockPool.blocks`` and one running request's block table from vLLM's manager, wrapping
round the pool (every block once in ``AUDIT_PASS_STEPS`` steps). Here each slice is
compared with the ledger as that step left it: the ledger is fed by the probe's ops and
keyframes, so a mirror that drifted from vLLM (a vLLM change the probe does not see, a
bug) shows up as a mismatch here, which no comparison of the mirror with itself can show.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvscope.state.ledger import Ledger
from kvscope_probe import wire

KINDS = ("block_state", "request_table", "probe_mirror")
"""What an audit found different from vLLM: a block's state in the ledger, a running
request's table in the ledger, a block's state in the probe's mirror (set right there)."""


@dataclass
class AuditCounts:
    blocks: int = 0
    """Blocks of vLLM's pool compared with an in-sync ledger."""
    tables: int = 0
    """Request tables compared with an in-sync ledger."""
    mismatches: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    passes: int = 0
    """Complete passes over the pool (every block compared once, in order)."""
    pass_seconds: float | None = None
    """How long the last complete pass took (from its first slice to the next pass's)."""
    _pass_start: float | None = None
    _next: int = 0
    """Block the next slice should start at for the pass to stay unbroken."""


def check(counts: AuditCounts, led: Ledger, a: wire.Audit) -> bool:
    """Compare one audit with the ledger; True when the ledger disagreed with vLLM (the
    caller marks it stale: it is repaired by the next keyframe)."""
    counts.mismatches["probe_mirror"] += a.mirror_fixed
    n = len(a.states)
    if not led.synced or a.lo < 0 or a.lo + n > led.num_blocks:
        counts._pass_start = None  # a stale ledger breaks the pass
        return False
    bad = 0
    if n:
        mine = np.frombuffer(led.states, np.uint8, n, a.lo)
        bad = int(np.count_nonzero(mine != np.frombuffer(a.states, np.uint8)))
    counts.blocks += n
    wrong_table = False
    if a.req_id:
        counts.tables += 1
        wrong_table = led.tables.get(a.req_id) != a.table
    counts.mismatches["block_state"] += bad
    counts.mismatches["request_table"] += wrong_table
    _track_pass(counts, a.lo, n, led.num_blocks)
    return bool(bad or wrong_table)


def _track_pass(counts: AuditCounts, lo: int, n: int, num_blocks: int) -> None:
    """A pass: from one slice at block 0 to the next, every slice between in order."""
    now = time.monotonic()
    if lo == 0:
        if counts._pass_start is not None and counts._next >= num_blocks:
            counts.passes += 1
            counts.pass_seconds = now - counts._pass_start
        counts._pass_start = now
    elif lo != counts._next:
        counts._pass_start = None  # a slice missed (a gap): this pass is not whole
    counts._next = lo + n
