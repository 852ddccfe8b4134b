"""Ledger semantics on hand-made op sequences."""

from __future__ import annotations

import pytest

from kvscope.state.ledger import Ledger
from kvscope_probe import wire
from tests.unit.test_wire import hello, step


def synced(n: int = 10) -> Ledger:
    led = Ledger(n, [4])
    led.load(wire.Keyframe(hello=hello(num_blocks=n), states=bytes([3] + [0] * (n - 1)),
                           tables={}, tokens={}))
    return led


def test_ops_move_counts_and_runs() -> None:
    led = synced()
    assert (led.free, led.cached, led.max_contiguous_free()) == (9, 0, 9)
    led.apply([(wire.OP_ALLOC, [4, 5])])
    assert led.free == 7 and led.used == 2
    assert sorted(led.free_runs().tolist()) == [3, 4]
    led.apply([(wire.OP_FREE_CACHED, [4]), (wire.OP_FREE, [5])])
    assert (led.free, led.cached) == (9, 1)
    led.apply([(wire.OP_ALLOC, [4])])  # reusing a cached block evicts it
    assert (led.free, led.cached) == (8, 0)
    led.apply([(wire.OP_FREE_CACHED, [4]), (wire.OP_UNCACHE, [4, 6])])
    assert (led.free, led.cached) == (9, 0)
    led.apply([(wire.OP_ALLOC, [1]), (wire.OP_FREE_CACHED, [1]), (wire.OP_UNCACHE_ALL, [])])
    assert led.cached == 0 and led.free == 9


def test_block_outside_pool_is_an_error_not_a_crash() -> None:
    led = synced()
    with pytest.raises(ValueError):
        led.apply([(wire.OP_ALLOC, [10])])
    with pytest.raises(ValueError):
        led.apply([(wire.OP_ALLOC, [0])])  # the null block is never allocated
    with pytest.raises(ValueError):
        led.apply([(99, [1])])


def test_tail_waste_counts_unfilled_slots_of_last_blocks() -> None:
    led = synced()
    led.apply_tables(step(new_reqs=[wire.NewReq("a", [[1, 2]], 0)],
                          num_scheduled={"a": 5}))  # 2 blocks of 4 -> 3 unfilled
    led.apply_tables(step(new_reqs=[wire.NewReq("b", [[3]], 0)],
                          num_scheduled={"b": 4}))  # a not scheduled: it holds what it had
    assert led.tokens == {"a": 5, "b": 4}
    assert led.tail_waste_tokens() == 3
    led.apply_tables(step(num_scheduled={"a": 4}, cached_ids=["a"], cached_computed=[5],
                          grown_ids=["a"], grown_blocks=[[[4]]]))
    assert led.tables["a"] == [[1, 2, 4]] and led.tokens["a"] == 9
    assert led.tail_waste_tokens() == 3
    led.apply_tables(step(finished=["a"]))
    assert led.tail_waste_tokens() == 0 and "a" not in led.tables


def test_sliding_window_blocks_become_null_placeholders_before_the_table_grows() -> None:
    """vLLM's sliding-window manager replaces blocks that left the window by the null
    block and frees them; a freed block may come straight back to the same request."""
    led = Ledger(10, [4, 4])
    led.apply_tables(step(new_reqs=[wire.NewReq("a", [[1, 2], [3, 4]], 0)],
                          num_scheduled={"a": 8}))
    led.apply_tables(step(num_scheduled={"a": 1}, cached_ids=["a"], cached_computed=[8],
                          nulled=[wire.Nulled("a", 1, [3])],
                          grown_ids=["a"], grown_blocks=[[[5], [3]]]))
    assert led.tables["a"] == [[1, 2, 5], [0, 4, 3]]
    # The released block held a full block of tokens that left the window: no waste.
    assert led.tail_waste_by_group() == [3, 3]


def test_keyframe_reports_disagreement_only_when_in_sync() -> None:
    led = Ledger(10, [4])
    kf = wire.Keyframe(hello=hello(num_blocks=10), states=bytes([3] + [0] * 9), tables={},
                       tokens={})
    assert led.load(kf) is False  # stale ledger: adopting is not a mismatch
    led.apply([(wire.OP_ALLOC, [2])])
    assert led.load(kf) is True  # in sync but different: a mismatch
    assert led.free == 9
    with pytest.raises(ValueError):
        led.load(wire.Keyframe(hello=hello(), states=b"\x00", tables={}, tokens={}))


def _sliced(tables: dict[str, list[list[int]]], pending: list[str],
            used: tuple[int, ...] = (1, 2, 3, 4)) -> wire.Keyframe:
    states = bytes([3] + [2 if i in used else 0 for i in range(1, 10)])
    return wire.Keyframe(hello=hello(num_blocks=10), states=states, tables=tables,
                         tokens={"a": 4, "b": 8}, pending=pending)


def test_a_keyframe_sent_across_steps_syncs_a_stale_ledger_only_with_its_last_slice() -> None:
    """A large pool's keyframe comes as a first slice of tables and the rest in the next
    steps' KeyframeTables: a stale ledger is exact only once every table has come, and a
    gap before the last slice leaves it stale (the slices after it complete nothing)."""
    led = Ledger(10, [4])
    assert led.load(_sliced({"a": [[1]]}, ["b"])) is False
    assert not led.synced and led.free == 5  # the states are whole; b's table is not here
    assert led.load_tables(wire.KeyframeTables({"b": [[2, 3]]}, last=False)) is False
    assert not led.synced
    assert led.load_tables(wire.KeyframeTables({}, last=True)) is False
    assert led.synced and led.tables == {"a": [[1]], "b": [[2, 3]]}
    assert led.tokens == {"a": 4, "b": 8}
    # stale again, a new keyframe begins, and a gap comes before its last slice
    led.stale()
    led.load(_sliced({"a": [[1]]}, ["b"]))
    led.stale()
    led.load_tables(wire.KeyframeTables({"b": [[2, 3, 4]]}, last=True))
    assert not led.synced


def test_an_in_sync_ledger_keeps_its_tables_until_the_slices_and_counts_disagreement() -> None:
    led = Ledger(10, [4])
    led.load(_sliced({"a": [[1]], "b": [[2, 3]]}, []))
    assert led.synced
    # the same pool sent across steps: b's own table stays (and in sync) until its slice
    assert led.load(_sliced({"a": [[1]]}, ["b"])) is False
    assert led.synced and led.tables["b"] == [[2, 3]]
    assert led.load_tables(wire.KeyframeTables({"b": [[2, 3]]}, last=True)) is False
    # a slice that disagrees with an in-sync ledger is a mismatch, and it is adopted
    led.load(_sliced({"a": [[1]]}, ["b"]))
    assert led.load_tables(wire.KeyframeTables({"b": [[2, 4]]}, last=True)) is True
    assert led.tables["b"] == [[2, 4]]
    # a keyframe whose pending requests the ledger does not hold disagrees too
    assert led.load(_sliced({"a": [[1]]}, ["b", "c"])) is True
    # a slice naming a block outside the pool is refused before anything changes
    with pytest.raises(ValueError):
        led.load_tables(wire.KeyframeTables({"b": [[2, 10]]}, last=True))
    assert led.tables["b"] == [[2, 4]]
