"""The store's encoder does its imports as the sidecar starts, not on the first batch.

pyarrow imports pandas (~400 modules, ~0.2 s of CPU) at its first conversion from numpy;
in a live sidecar that landed in the batching thread as the first engine's rows arrived
(the whole batch thread's CPU of a 16 s live run, ~0.4 s, was mostly imports).
``arrow.warm`` (called by ``ClickHouseSink``) must leave nothing to import for a real batch
of any table. Run in a fresh interpreter: this one has imported everything already.
"""

from __future__ import annotations

from tests.fresh import last_json_line

PROBE = r"""
import json, sys
from dataclasses import fields
from kvscope.rows import TABLES
from kvscope.store import arrow

VALUE = {"int": 1, "float": 1.5, "str": "x", "bool": True, "list[int]": [1, 2],
         "list[str]": ["x"], "list[list[list[int]]]": [[[1, 2]]]}

def row(cls):
    kinds = {f.name: f.type if isinstance(f.type, str) else f.type.__name__
             for f in fields(cls)}
    return cls(**{name: VALUE[kind] for name, kind in kinds.items()})

before = set(sys.modules)
arrow.warm(sorted(TABLES))
warmed = len(set(sys.modules) - before)
before = set(sys.modules)
sizes = {t: len(arrow.encode(t, [row(cls), row(cls)])) for t, cls in TABLES.items()}
print(json.dumps({"warmed": warmed, "late": sorted(set(sys.modules) - before),
                  "sizes": sizes}))
"""


def test_a_real_batch_of_every_table_imports_nothing_after_warm() -> None:
    got = last_json_line(PROBE)
    assert got["warmed"] > 0  # the imports happened at warm()
    assert got["late"] == []
    assert all(n > 0 for n in got["sizes"].values()) and len(got["sizes"]) >= 8


SINK = r"""
import json, sys, tempfile
from kvscope.store.sink import ClickHouseSink
before = set(sys.modules)
sink = ClickHouseSink("http://127.0.0.1:9", spool_dir=tempfile.mkdtemp())
print(json.dumps({"pandas_at_start": "pandas" in set(sys.modules) - before}))
sink.close(0.5)
"""


def test_the_clickhouse_sink_warms_its_encoder_as_it_starts() -> None:
    assert last_json_line(SINK) == {"pandas_at_start": True}
