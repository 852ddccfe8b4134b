"""A sender lives as long as its scheduler; "switched off" leaves nothing behind."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin, recorder
from kvscope_probe.recorder import Recorder
from tests.twin.probe_trail import need_fails

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin


def senders_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvscope-probe-sender"]


def test_three_schedulers_in_turn_leave_one_sender_and_no_pinned_pool(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As re-creating vllm.LLM does: each engine builds a scheduler (the probe attaches
    in its __init__), the previous one is dropped."""
    plugin.stop_all()
    monkeypatch.setenv(plugin.ENV_ENDPOINT, f"ipc://{tmp_path}/nobody.sock")
    monkeypatch.setenv("KVSCOPE_PROBE_FLUSH_S", "0.02")
    plugin.register()  # what vLLM calls in each of its processes
    try:
        dead: list[weakref.ref[Any]] = []
        twin = None
        for _ in range(3):
            if twin is not None:
                dead += [weakref.ref(twin.scheduler), weakref.ref(
                    twin.scheduler.kv_cache_manager.block_pool)]
            twin = Twin(TwinConfig(num_blocks=48), seed=3)
            assert isinstance(twin.scheduler._kvscope, Recorder)  # it records
            twin.run(generate(WorkloadSpec(n_requests=4, seed=1)))
        # A sender thread holds its Recorder for the moment of a wakeup: a collection
        # that falls into one frees it at the next. Each sender ends within a flush
        # interval of its Recorder going.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                any(r() is not None for r in dead) or len(senders_alive()) > 1):
            gc.collect()
            time.sleep(0.05)
        assert [r() for r in dead] == [None] * 4  # schedulers and pools collected
        assert len(senders_alive()) == 1
        assert twin is not None and twin.scheduler._kvscope.enabled
    finally:
        plugin.stop_all()
        plugin.enable(None)


def test_switched_off_removes_the_blocks_needed_hook_and_every_hook_goes_inert(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The blocks-needed hook's own work raises, so the switch-off comes while it is
    # installed on vLLM's coordinator.
    NeedFails = need_fails(RuntimeError)  # noqa: N806 - a class

    monkeypatch.setattr(recorder, "MAX_FAULTS", 5)
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    rec = NeedFails(twin.scheduler, ring_size=1 << 20, keyframe_interval_s=3600)
    plugin.bind(twin.scheduler, rec)
    result = twin.run(generate(WorkloadSpec(n_requests=60, seed=3)))
    assert result.finished == 60
    assert not rec.enabled
    assert rec.faults == 5  # nothing ran after the switch-off
    coord = rec.mgr.coordinator
    assert "get_num_blocks_to_allocate" not in coord.__dict__ and not rec.need_armed
