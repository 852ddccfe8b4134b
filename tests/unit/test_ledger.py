"""Ledger semantics on hand-made op sequences."""

from __future__ import annotations

import pytest

from kvscope.sidecar.ledger import Ledger
from kvscope_probe import wire
from tests.unit.test_wire import hello


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
    led.set_table("a", [[1, 2]], tokens=5)  # 2 blocks of 4 -> 3 unfilled
    led.extend_table("b", [[3]], tokens=4)  # full block
    assert led.tail_waste_tokens() == 3
    led.extend_table("a", [[4]], tokens=9)
    assert led.tail_waste_tokens() == 3
    led.drop_request("a")
    assert led.tail_waste_tokens() == 0


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
