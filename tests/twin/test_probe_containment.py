"""Containment by construction: a fault in any part of any hook leaves vLLM's schedule
exactly as an unprobed run's, step for step.

The hooks are enumerated from the probe's own registry (``guard.REGISTRY``), so a hook
added later is covered here without editing this file. The baseline is a run in a
process that never imports the probe (``tests.twin.probe_trail``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvscope_probe import guard, plugin
from kvscope_probe.recorder import Recorder
from tests.twin.probe_trail import config, need_fails, trail

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin
LAYOUT = "full+sliding"  # a sliding window: the manager hooks run too
NOT_REACHED = {
    "BlockPool.unpin_blocks": "pinned blocks come with a KV connector's loads",
    "MambaManager._remove_blocks_in_range": "a Mamba layout",
    "MambaManager._relocate_speculative_block": "Mamba with speculative decoding",
}
"""Hooks this run never calls, so a fault injected there proves nothing (yet)."""


@pytest.fixture(scope="module")
def baseline() -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tests.twin.probe_trail", LAYOUT],
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


class Injected(RuntimeError):
    pass


def boom(*_a: Any, **_k: Any) -> Any:
    raise Injected("injected")


def probed_trail(rec_cls: type[Recorder] = Recorder) -> tuple[dict[str, Any], Recorder]:
    assert plugin.enable(None)
    twin = Twin(config(LAYOUT), seed=5)
    rec = rec_cls(twin.scheduler, ring_size=1 << 20, keyframe_interval_s=3600)
    plugin.bind(twin.scheduler, rec)
    return trail(twin), rec


def test_the_registry_holds_every_class_level_hook() -> None:
    assert plugin.enable(None)
    names = set(guard.REGISTRY)
    assert {"Scheduler.__init__", "Scheduler.schedule", "Scheduler.add_request",
            "Scheduler._preempt_request", "Scheduler._free_request", "BlockPool.touch",
            "BlockPool.get_new_blocks", "BlockPool.free_blocks", "BlockPool.unpin_blocks",
            "BlockPool.evict_blocks", "BlockPool.reset_prefix_cache",
            "SingleTypeKVCacheManager._remove_blocks_in_range"} <= names
    for h in guard.REGISTRY.values():  # each is what the class holds now
        assert getattr(h.owner, h.attr)._kvscope_hook is h, h.name


def test_unfaulted_the_probed_schedule_equals_the_unprobed_one(
        baseline: dict[str, Any]) -> None:
    got, rec = probed_trail()
    assert rec.faults == 0 and not rec.enabled  # recorded until vLLM shut it down
    assert rec.seq > len(got["steps"])  # a record a step, and the keyframe
    assert got == baseline
    assert baseline["preemptions"] > 0 and baseline["finished"] == 40


def _parts() -> list[tuple[str, tuple[str, ...]]]:
    plugin.enable(None)
    cases = []
    for name, h in sorted(guard.REGISTRY.items()):
        cases.append((name, ("rec_of",)))
        kv = tuple(p for p in ("before", "after") if getattr(h, p) is not None)
        if kv:
            cases.append((name, kv))
    return cases


@pytest.mark.parametrize(("name", "parts"), _parts(), ids=lambda v: str(v))
def test_a_fault_in_each_hook_part_changes_nothing_vllm_decides(
        name: str, parts: tuple[str, ...], baseline: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = guard.REGISTRY[name]
    calls = {"n": 0}

    def counted(*a: Any, **k: Any) -> Any:
        calls["n"] += 1
        raise Injected(name)

    for p in parts:
        monkeypatch.setattr(h, p, counted)
    before_unguarded = h.unguarded_faults
    got, rec = probed_trail()
    monkeypatch.undo()
    assert got == baseline  # vLLM's decisions, step for step
    # Every injected fault was counted (by the Recorder, or by the hook when there was no
    # Recorder to count it), none escaped: the run above finished.
    counted_faults = rec.faults + h.unguarded_faults - before_unguarded
    assert counted_faults == calls["n"]
    assert (calls["n"] > 0) == (name not in NOT_REACHED)


def test_a_fault_in_the_blocks_needed_hook_changes_nothing(baseline: dict[str, Any]) -> None:
    # The per-instance hook's own work (storing the need) raises.
    got, rec = probed_trail(need_fails(Injected))
    assert got == baseline
    assert rec.faults > 0  # the hook was armed and its faults were counted


def attach_failed() -> Any:
    """A twin whose scheduler the probe tried to attach to, with an endpoint set, and
    failed (the test has made it fail): marked, never tried again."""
    assert plugin.enable(None)
    twin = Twin(config(LAYOUT), seed=5)
    twin.scheduler._kvscope = None
    plugin._endpoint = "ipc:///nonexistent/kvscope-test.sock"
    try:
        assert plugin.attach(twin.scheduler) is None
    finally:
        plugin.enable(None)
    assert not twin.scheduler._kvscope.enabled
    return twin


def test_a_bind_that_fails_halfway_leaves_nothing_recording(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``bind`` points the pool at the Recorder, then arms the blocks-needed watch; when
    that last part fails, ``attach`` gives the scheduler up. The pool's hooks must stop
    too: left pointing at an enabled Recorder whose steps never run again, every
    allocation and free appended to its operation list for the engine's lifetime."""
    monkeypatch.setattr(Recorder, "watch_need", boom)
    twin = attach_failed()
    left = twin.scheduler.kv_cache_manager.block_pool._kvscope
    assert left is None or not left.enabled
    before = trail(Twin(config(LAYOUT), seed=5))  # a fresh engine, unprobed
    twin_trail = trail(twin)
    assert twin_trail == before  # and vLLM decided as without the probe


class _Once:
    """A one-shot iterator over ``items`` that raises ``error`` after them, if given."""

    def __init__(self, items: list[Any], error: Exception | None = None) -> None:
        self.items, self.error = iter(items), error

    def __iter__(self) -> _Once:
        return self

    def __next__(self) -> Any:
        for x in self.items:
            return x
        if self.error is not None:
            raise self.error
        raise StopIteration


def _probed_pool() -> tuple[Any, Recorder]:
    assert plugin.enable(None)
    twin = Twin(config(LAYOUT), seed=5)
    rec = Recorder(twin.scheduler, ring_size=1 << 20, keyframe_interval_s=3600)
    plugin.bind(twin.scheduler, rec)
    return twin.scheduler.kv_cache_manager.block_pool, rec


def test_touch_given_a_one_shot_iterator_touches_what_vllm_would() -> None:
    """``touch``'s before part reads the blocks it is given; given a one-shot iterator
    (vLLM's signature takes any iterable), vLLM must still get every block."""
    pool, rec = _probed_pool()
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (0, 0)
    pool.touch(_Once([a, b]))
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert rec.faults == 0


def test_a_blocks_argument_that_fails_halfway_fails_in_vllm_as_without_the_probe() -> None:
    """An iterable that raises partway: vLLM's loop takes the items before the error and
    then raises it, probe or not. The probe reads the items first (to record them) and
    must hand vLLM the same sequence and the same error, never a half-read iterator."""
    pool, rec = _probed_pool()
    a, b = pool.get_new_blocks(2)
    with pytest.raises(Injected):
        pool.free_blocks(_Once([a, b], Injected("a caller's iterable failed")))
    assert (a.ref_cnt, b.ref_cnt) == (0, 0)  # vLLM's loop freed both, then raised
    assert rec.faults == 1 and rec.want_keyframe  # not recorded: the mirror is repaired


def test_a_probe_that_cannot_import_its_parts_is_tried_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken install (the sender's module unimportable): the scheduler is marked and
    left alone, not attached again (a search of sys.path) at every step and arrival."""
    monkeypatch.setitem(sys.modules, "kvscope_probe.sender", None)
    attach_failed()
