"""``kvscope serve`` runs the cyclic collector so that a frame's burst of lists does not
set it off (``kvscope.sidecar.cyclic_gc``).

A frame of ~23 decoding steps at 256 running decodes to ~1,600 tracked lists and tuples,
freed by reference counting once ingested. With CPython's default thresholds each such
frame ran a young collection or more; tuned, none. Run in a fresh interpreter: ``tune()``
changes the process's collector, and this one's must stay as pytest set it.
"""

from __future__ import annotations

from tests.fresh import last_json_line

PROBE = r"""
import gc, json, sys
from kvscope_probe import wire

def step(i):
    ids = [f"cmpl-{n:032x}-0" for n in range(256)]  # vLLM's request IDs, 256 running
    grown = ids[i * 16 % 256:][:16]
    return wire.Step(
        ts=float(i), ops=[(wire.OP_ALLOC, [1000 + 16 * i + k]) for k in range(16)],
        new_reqs=[], num_scheduled={}, cached_ids=ids,
        cached_computed=[300 + i + n for n in range(256)],
        grown_ids=grown, grown_blocks=[[[1000 + 16 * i + k]] for k in range(16)],
        resumed=[], nulled=[], relocated=[], finished=[], preempted=[], preemptions=[],
        arrivals=[], ends=[], scheduled_tokens=256, token_budget=8192, running=256,
        waiting=0, head_blocks_needed=0, head_req_id="", free_blocks=20000,
        schedule_ns=1, probe_ns=1, scheduled_counts=[1] * 256)

parts = wire.encode(wire.Frame(engine="0", session="s", first_seq=0, dropped=0, faults=0,
                               records=[step(i) for i in range(23)]))
young = []
gc.callbacks.append(lambda phase, info: phase == "start" and young.append(info["generation"]))

def frames(n):
    gc.collect()
    del young[:]
    for _ in range(n):
        frame = wire.decode(parts)  # held while its steps are ingested...
        held = gc.get_count()[0]
        del frame  # ... then freed by reference counting
    return len(young), held

default = frames(20)
from kvscope.sidecar import cyclic_gc
cyclic_gc.tune()
tuned = frames(20)
print(json.dumps({"default": default, "tuned": tuned, "threshold": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(), "gen0": cyclic_gc.GEN0_THRESHOLD}))
"""


def test_a_decoded_frame_is_freed_before_any_collection_once_tuned() -> None:
    got = last_json_line(PROBE)
    collections, held = got["tuned"]
    assert held > 1500  # the frame is the burst the module is about (counted uncollected)...
    assert got["default"][0] >= 20  # ... CPython's default collects in each of the 20...
    assert collections == 0  # ... and tuned, none
    assert got["threshold"] == [got["gen0"], 10, 10]
    assert got["frozen"] > 1000  # the start-up heap (the modules imported) left its view
