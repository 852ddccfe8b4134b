"""Layout snapshots and the sampler, from hand-made probe frames fed to a real Hub."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvscope.layout.history import layout_rows
from kvscope.layout.sampler import LayoutSampler, decode_runs, encode_runs
from kvscope.layout.snapshot import fragments
from kvscope.state.hub import Hub
from kvscope_probe import wire
from tests.unit.test_hub import feed
from tests.unit.test_wire import hello, step

F, C, U, N = wire.STATE_FREE, wire.STATE_CACHED, wire.STATE_USED, wire.STATE_NULL
ROOT = Path(__file__).resolve().parents[2]


def pool(states: list[int], tables: dict[str, list[list[int]]], tokens: dict[str, int],
         groups: int = 1) -> Hub:
    """A Hub holding one engine whose ledger is exactly this keyframe."""
    kv = [wire.KVGroup("FullAttentionSpec", 16) for _ in range(groups)]
    h = hello(num_blocks=len(states), kv_groups=kv)
    kf = wire.Keyframe(hello=h, states=bytes(states), tables=tables, tokens=tokens)
    hub = Hub()
    assert feed(hub, [h, step(), kf], 0)
    return hub


def test_fragments_count_runs_of_consecutive_ids_and_skip_the_null_block() -> None:
    assert fragments([]) == 0
    assert fragments([4, 5, 6]) == 1
    assert fragments([4, 5, 9, 10, 2]) == 3
    assert fragments([0, 0, 7, 8]) == 1  # sliding-window tables hold null placeholders


def test_runs_round_trip() -> None:
    s = np.array([3, 2, 2, 2, 0, 1, 1], np.uint8)
    o = np.array([-1, 0, 0, 1, -1, -1, -1], np.int32)
    g = np.zeros(7, np.int16)
    runs = encode_runs(s, o, g)
    assert runs.tolist() == [[3, -1, 0, 1], [2, 0, 0, 2], [2, 1, 0, 1], [0, -1, 0, 1],
                             [1, -1, 0, 2]]
    for a, b in zip(decode_runs(runs), (s, o, g), strict=True):
        assert a.tolist() == b.tolist()


def test_a_snapshot_names_owners_states_and_figures() -> None:
    #          0  1  2  3  4  5  6  7  8  9
    states = [N, U, U, F, U, U, C, C, F, U]
    hub = pool(states, {"a": [[1, 2, 9]], "b": [[4, 5, 1]]}, {"a": 40, "b": 33})
    sampler = LayoutSampler(hub)
    (snap,) = sampler.tick(now=100.0)
    assert snap.runs.tolist() == [
        [N, -1, 0, 1], [U, 0, 0, 2], [F, -1, 0, 1], [U, 1, 0, 2], [C, -1, 0, 2],
        [F, -1, 0, 1], [U, 0, 0, 1]]
    a, b = snap.owners
    # block 1 is in both tables: shared for each (freeing either frees none of it)
    assert (a.req_id, a.blocks, a.fragments, a.tokens, a.shared_blocks) == ("a", 3, 2, 40, 1)
    assert (b.req_id, b.blocks, b.fragments, b.tokens, b.shared_blocks) == ("b", 3, 2, 33, 1)
    assert (snap.free_blocks, snap.cached_blocks, snap.used_blocks) == (4, 2, 5)
    assert snap.max_contiguous_free == 3  # blocks 6, 7, 8
    assert hub.engines["0"].ledger.max_contiguous_free() == snap.max_contiguous_free
    assert (snap.engine, snap.model, snap.step, snap.ts) == ("0", "tiny", 1, 100.0)


def test_with_several_kv_groups_allocated_blocks_carry_their_group() -> None:
    states = [N, U, U, F, U, C]
    hub = pool(states, {"a": [[1], [2, 4]]}, {"a": 16}, groups=2)
    (snap,) = LayoutSampler(hub).tick(now=1.0)
    _, owner, group = decode_runs(snap.runs)
    assert group.tolist() == [-1, 0, 1, -1, 1, -1]  # free, cached and null are shared
    assert owner.tolist() == [-1, 0, 0, -1, 0, -1]
    assert snap.owners[0].blocks == 3 and snap.owners[0].fragments == 3  # 1 + 2 runs


def test_sampling_is_rate_limited_and_an_idle_engine_costs_no_new_bytes() -> None:
    hub = pool([N, U, F, F], {"a": [[1]]}, {"a": 3})
    sampler = LayoutSampler(hub, interval_s=1.0)
    (first,) = sampler.tick(now=10.0)
    assert sampler.tick(now=10.5) == []
    (again,) = sampler.tick(now=11.0)
    assert again.runs is first.runs and again.cost == 0 and again.ts == 11.0
    feed(hub, [step(ops=[(wire.OP_ALLOC, [2])], free_blocks=1)], 3)
    (moved,) = sampler.tick(now=12.0)
    assert moved.used_blocks == 2 and moved.cost > 0
    assert [p.free_blocks for p in sampler.points("0")] == [2, 2, 1]
    assert [s.ts for s in sampler.snapshots("0", 10.5, 12.0)] == [11.0, 12.0]


def test_a_sample_is_built_when_first_read_and_its_build_is_counted_in_the_history() -> None:
    """The sampler copies the pool each tick; its runs and owners are built only when
    read (once, whoever reads), and the bytes the build adds are counted against the
    history's bound; a sample that left the history is not counted when read later."""
    hub = pool([N, U, U, F, U, C, F, F], {"a": [[1, 2]], "b": [[4]]}, {"a": 20, "b": 9})
    sampler = LayoutSampler(hub, history=2)
    (first,) = sampler.tick(now=1.0)
    assert not first.layout.is_built
    assert sampler._bytes["0"] == first.cost
    assert (first.free_blocks, first.used_blocks, first.max_contiguous_free) == (4, 3, 3)
    runs = first.runs
    assert first.layout.is_built and first.runs is runs
    assert [o.req_id for o in first.owners] == ["a", "b"]
    assert [o.tokens for o in first.owners] == [20, 9]
    added = runs.nbytes - 8  # the runs, less the copy's states (a byte a block: 6 runs)
    assert first.layout.charged == added
    assert sampler._bytes["0"] == first.cost + added
    feed(hub, [step(ops=[(wire.OP_ALLOC, [3])], free_blocks=3)], 3)
    (second,) = sampler.tick(now=2.0)
    feed(hub, [step(ops=[(wire.OP_ALLOC, [6])], free_blocks=2)], 4)
    (third,) = sampler.tick(now=3.0)  # the first leaves (two kept)
    assert sampler._bytes["0"] == second.cost + third.cost
    assert sampler.snapshots("0", 0, 10) == [second, third]
    feed(hub, [step(ops=[(wire.OP_ALLOC, [7])], free_blocks=1)], 5)
    sampler.tick(now=4.0)  # the second leaves, never read
    kept = sampler.snapshots("0", 0, 10)
    assert second.runs.tolist() == [[N, -1, 0, 1], [U, 0, 0, 2], [U, -1, 0, 1], [U, 1, 0, 1],
                                    [C, -1, 0, 1], [F, -1, 0, 2]]  # block 3: no table's
    assert second.layout.charged == 0  # built after it left: not counted
    assert sampler._bytes["0"] == sum(s.cost for s in kept)


def test_a_copy_keeps_a_pools_states_as_runs_where_they_are_smaller() -> None:
    from kvscope.layout.snapshot import StateRuns

    idle = bytes([N] + [F] * 500 + [U] * 20 + [C] * 3 + [F] * 99)
    busy = bytes([N] + [U, F, U, C] * 30)
    for states, form in ((idle, "runs"), (busy, "bytes"), (b"", "bytes"), (bytes([N]), "runs")):
        s = StateRuns.of(states)
        assert ("runs" if s.starts is not None else "bytes") == form
        assert s.expand().tobytes() == states
        assert s.counts() == [states.count(k) for k in (F, C, U, N)]
        assert s.nbytes == (5 * s.starts.size if s.starts is not None else len(states))
    assert StateRuns.of(idle).nbytes == 5 * 5  # null, free, used, cached, free


def test_a_stale_ledger_is_not_sampled_and_says_so() -> None:
    hub = pool([N, F, F], {}, {})
    sampler = LayoutSampler(hub)
    sampler.tick(now=1.0)
    feed(hub, [step()], 9)  # records 3..8 never arrived: a gap
    assert sampler.tick(now=2.0) == []
    assert sampler.is_stale("0")
    assert sampler.points("0")[-1].free_blocks is None
    assert sampler.latest("0").ts == 1.0  # the last exact one is kept, not updated
    feed(hub, [step(), wire.Keyframe(hello=hello(num_blocks=3), states=bytes([N, U, F]),
                                     tables={}, tokens={})], 10)
    (snap,) = sampler.tick(now=3.0)
    assert not sampler.is_stale("0") and snap.used_blocks == 1


def test_history_is_bounded_by_count_and_by_bytes() -> None:
    hub = pool([N] + [F] * 63, {}, {})
    sampler = LayoutSampler(hub, history=5)
    for t in range(20):
        feed(hub, [step(ops=[(wire.OP_ALLOC, [1 + t])], free_blocks=62 - t)], 3 + t)
        sampler.tick(now=float(t))
    assert len(sampler.snapshots("0", 0, 100)) == 5 and len(sampler.points("0")) == 5
    tight = LayoutSampler(hub, history=600, history_bytes=1)
    for t in range(3):
        tight.tick(now=float(t))
        feed(hub, [step()], 23 + t)
    assert len(tight.snapshots("0", 0, 100)) == 1  # never fewer than the latest


def test_subscribers_get_every_new_snapshot() -> None:
    hub = pool([N, F], {}, {})
    sampler = LayoutSampler(hub)
    got: list[float] = []
    sampler.subscribe(lambda s: got.append(s.ts))
    sampler.tick(now=1.0)
    sampler.tick(now=2.0)
    assert got == [1.0, 2.0]


def test_layout_rows_fill_every_column_of_the_table() -> None:
    hub = pool([N, U, U, C, F], {"a": [[2, 1]]}, {"a": 20})
    (snap,) = LayoutSampler(hub).tick(now=1_700_000_000.25)
    (row,) = layout_rows(snap)
    ddl = (ROOT / "clickhouse/schema/050_layout_snapshots.sql").read_text()
    body = ddl[ddl.index("(") + 1: ddl.index("ENGINE")]
    columns = re.findall(r"^\s+([a-z_]+) ", body, flags=re.M)
    assert list(row) == columns
    assert row["states"] == [N, U, U, C, F]
    assert row["owner"] == [0, 1, 1, 0, 0] and row["owner_req_ids"] == ["a"]
    assert row["block_group"] == [0] * 5
    assert row["owner_fragments"] == [2]  # 2 then 1: two runs, not one
    assert row["ts"] == 1_700_000_000.25


def test_layout_rows_as_arrays_encode_as_the_lists_do() -> None:
    """The sidecar hands its store the per-block columns as numpy arrays (one concatenation
    in the Arrow encoder, not a Python int per block); the batch is the same."""
    from kvscope.layout.history import to_row
    from kvscope.store import arrow

    hub = pool([N, U, U, C, F, U, U, U], {"a": [[2, 1]], "b": [[5, 6, 7]]}, {"a": 20, "b": 40})
    sampler = LayoutSampler(hub)
    snaps = [*sampler.tick(now=1_700_000_000.0), *sampler.tick(now=1_700_000_001.0)]
    lists = [to_row(r) for s in snaps for r in layout_rows(s)]
    arrays = [to_row(r) for s in snaps for r in layout_rows(s, arrays=True)]
    assert isinstance(arrays[0].owner, np.ndarray) and isinstance(lists[0].owner, list)
    assert [r.owner.tolist() for r in arrays] == [r.owner for r in lists]
    a = arrow.to_record_batch("layout_snapshots", lists)
    b = arrow.to_record_batch("layout_snapshots", arrays)
    assert a.equals(b) and a.num_rows == len(snaps)
    assert arrow.encode("layout_snapshots", lists) == arrow.encode("layout_snapshots", arrays)


def served_history_bytes(tmp_path: Path, env: dict[str, str]) -> int:
    """The layout sampler's bound in a sidecar built as ``kvscope serve`` builds it from
    ``env`` (built, never started)."""
    from kvscope.sidecar.config import from_sources
    from kvscope.sidecar.server import Sidecar

    cli = {"endpoints": (f"ipc://{tmp_path}/p.sock",)}
    base = {"KVSCOPE_CLICKHOUSE_DSN": "off", "KVSCOPE_DECISION_LOG": "off",
            "KVSCOPE_DATA_DIR": str(tmp_path)}
    return Sidecar(from_sources(cli, {**base, **env})).layout.history_bytes


def test_serve_bounds_each_engines_layout_history_as_configured(tmp_path: Path) -> None:
    """``--layout-history-bytes`` / ``KVSCOPE_LAYOUT_HISTORY_BYTES`` is the sampler's bound
    in a served sidecar (the bound itself: ``test_history_is_bounded_by_count_and_by_bytes``);
    less than 1 MiB is refused with the reason."""
    from kvscope.errors import ConfigError

    assert served_history_bytes(tmp_path, {}) == 64 << 20
    assert served_history_bytes(tmp_path, {"KVSCOPE_LAYOUT_HISTORY_BYTES": str(3 << 20)}) == (
        3 << 20)
    with pytest.raises(ConfigError) as err:
        served_history_bytes(tmp_path, {"KVSCOPE_LAYOUT_HISTORY_BYTES": str((1 << 20) - 1)})
    assert err.value.errors == ["layout history must be at least 1 MiB"]
