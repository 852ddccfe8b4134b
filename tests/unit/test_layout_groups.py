"""Each running request's block table per KV cache group, null placeholders included, in
the layout snapshot, /api/layout's JSON and a layout_snapshots row read back."""

from __future__ import annotations

from datetime import datetime, timezone

from kvscope.layout.api import snapshot_json
from kvscope.layout.history import COLUMNS, layout_rows, snapshot_from_row
from kvscope.layout.sampler import LayoutSampler
from kvscope.layout.snapshot import GroupTable, table_runs
from tests.unit.test_layout import C, F, N, U, pool
from tests.unit.test_layout_api import valid

# Block 0 is null; request "a" has slid out of its window in group 0 (two null entries).
STATES = [N, U, U, U, F, U, U, C]
TABLES = {"a": [[0, 0, 1, 2], [3, 5, 6]], "b": [[3], []]}


def test_table_runs_merge_consecutive_ids_and_null_placeholders() -> None:
    assert table_runs([0, 0, 7, 8, 9, 4]) == ((0, 2), (7, 3), (4, 1))
    assert table_runs([5, 4, 3]) == ((5, 1), (4, 1), (3, 1))  # descending is not a run
    assert table_runs([]) == ()
    t = GroupTable(table_runs([0, 0, 0, 3, 5, 6]))
    assert (t.blocks, t.null_blocks, t.fragments) == (3, 3, 2)


def test_owners_carry_their_table_per_group() -> None:
    hub = pool(STATES, TABLES, {"a": 100, "b": 10}, groups=2)
    (snap,) = LayoutSampler(hub).tick(now=1.0)
    a, b = snap.owners
    assert [t.runs for t in a.groups] == [((0, 2), (1, 2)), ((3, 1), (5, 2))]
    assert [t.runs for t in b.groups] == [((3, 1),), ()]
    assert a.blocks == 5 and a.fragments == 3  # the null placeholders are not blocks
    body = snapshot_json(snap, max_runs=100)
    valid(body, "snapshot")
    assert body["owners"][0]["groups"] == [
        {"group": 0, "blocks": 2, "null_blocks": 2, "fragments": 1, "table": [[0, 2], [1, 2]]},
        {"group": 1, "blocks": 3, "null_blocks": 0, "fragments": 2, "table": [[3, 1], [5, 2]]},
    ]


def test_a_stored_row_gives_the_tables_back() -> None:
    hub = pool(STATES, TABLES, {"a": 100, "b": 10}, groups=2)
    (snap,) = LayoutSampler(hub).tick(now=1_700_000_000.5)
    (row,) = layout_rows(snap)
    assert row["owner_group_runs"] == [[[0, 2, 1, 2], [3, 1, 5, 2]], [[3, 1], []]]
    stored = dict(row, ts=datetime.fromtimestamp(row["ts"], timezone.utc))
    back = snapshot_from_row(tuple(stored[c.strip()] for c in COLUMNS.split(",")))
    assert [[t.runs for t in o.groups] for o in back.owners] == \
        [[t.runs for t in o.groups] for o in snap.owners]
