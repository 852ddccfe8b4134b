"""A decision's log line: the same keys, values and time text as ``json.dumps`` of the
documented dict with ``datetime.isoformat`` gave, formatted for less."""

from __future__ import annotations

import json
import math
import random
from datetime import datetime, timezone

from kvscope.decisions.log import decision_line, iso_ms
from kvscope.rows import SchedulerDecision


def reference_iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds")


def edges() -> list[float]:
    """Times whose rounding to the microsecond or truncation to the millisecond is on a
    boundary, either side of it and across a second, a day and a year."""
    out = [0.0, 1.0, -1.0, -0.5, -1e-7, 1e-7, 1764950400.0, 1767225599.9999995,
           1767225599.9995, 1767225599.999499, 1767225599.0005, 1767225599.0004999]
    for base in (1764950400.0, 1767225600.0, 951782400.0):
        for frac in (0.0005, 0.0015, 0.9994995, 0.9995, 0.9999994, 0.9999995,
                     0.9999996, 0.0000005, 0.0000015, 0.1234565, 0.5):
            for x in (base + frac, base - frac):
                out += [x, math.nextafter(x, -math.inf), math.nextafter(x, math.inf)]
    return out


def test_the_time_text_is_isoformats_to_the_character() -> None:
    rng = random.Random(25)
    times = edges() + [rng.uniform(0, 4.1e9) for _ in range(20_000)]
    times += [1.764e9 + rng.randrange(10**9) / 1e6 for _ in range(20_000)]
    wrong = [(t, iso_ms(t), reference_iso(t)) for t in times if iso_ms(t) != reference_iso(t)]
    assert wrong == []


def row(**kw: object) -> SchedulerDecision:
    base: dict[str, object] = dict(
        ts=1764950457.9065, model="tiny", engine="0", decision="preempt", request_id="cmpl-1",
        reason="kv_full", blocks_needed=2, free_blocks=0, max_contiguous_free=0, tokens=64,
        policy="fcfs", msg='Preempting request cmpl-1 "x"\\ due to kv_full\n', server="s:1")
    return SchedulerDecision(**{**base, **kw})  # type: ignore[arg-type]


def reference_line(d: SchedulerDecision) -> str:
    """The line as json.dumps wrote it before (README: the decision log's keys)."""
    return json.dumps({
        "ts": reference_iso(d.ts), "level": "info", "logger": "kvscope.decisions",
        "server": d.server, "engine": d.engine, "model": d.model, "event": d.decision,
        "request_id": d.request_id, "reason": d.reason or None,
        "blocks_needed": None if d.blocks_needed < 0 else d.blocks_needed,
        "free_blocks": None if d.free_blocks < 0 else d.free_blocks,
        "max_contiguous": None if d.max_contiguous_free < 0 else d.max_contiguous_free,
        "tokens": None if d.tokens < 0 else d.tokens, "policy": d.policy, "msg": d.msg,
    }, separators=(",", ":"))


def test_a_line_of_ascii_is_json_dumps_to_the_character() -> None:
    """Printable ASCII and control characters (escaped by both)."""
    for d in (row(), row(reason="", blocks_needed=-1, free_blocks=-1, max_contiguous_free=-1,
                         tokens=-1, server="", decision="finish"),
              row(ts=0.0005, request_id="a\tb\x01", msg="\x1f")):
        assert decision_line(d) == reference_line(d)


def test_other_text_is_utf8_and_reads_back_the_same() -> None:
    d = row(request_id="req-é-日本-\u2028\x7f", msg="Preempting request req-é-日本-\u2028")
    line = decision_line(d)
    assert "\n" not in line
    assert "req-é-日本" in line
    assert json.loads(line) == json.loads(reference_line(d))
