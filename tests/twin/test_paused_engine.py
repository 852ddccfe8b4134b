"""An engine vLLM pauses with its requests kept is idle, not stalled.

vLLM's engine loop calls ``schedule()`` only while ``Scheduler.has_requests()``; under
``POST /pause`` mode ``keep`` (``PauseState.PAUSED_ALL``) ``get_num_unfinished_requests()``
is 0 with requests still running, so the probe heartbeats and sends no step. The
heartbeat carries vLLM's own count, the sidecar exports it while the engine is idle, and
KVScopeEngineStalled (tests alerts/tests/health.yml) spares an engine counted at 0.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.twin import TwinConfig
from kvscope.twin.probed import ProbedTwin
from kvscope.twin.workload import TwinRequest
from kvscope_probe import wire
from kvscope_probe.sender import unfinished

pytestmark = pytest.mark.twin


def test_a_paused_engine_reads_no_unfinished_requests_from_vllm_itself() -> None:
    from vllm.v1.core.sched.interface import PauseState

    pt = ProbedTwin(TwinConfig(num_blocks=48), seed=1)
    sched = pt.scheduler
    for i in range(3):
        pt.twin.add(TwinRequest(f"r{i}", (i + 1,) * 40, 200, 0, 0))
    pt.twin.step()
    pt.drain()
    assert len(sched.running) == 3 and unfinished(sched) == 3
    sched.set_pause_state(PauseState.PAUSED_ALL)
    assert not sched.has_requests() and len(sched.running) == 3  # vLLM will not step
    assert unfinished(sched) == 0

    st = pt.state
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(pt.hub))  # type: ignore[arg-type]
    lv = {"server": st.server, "engine": st.engine, "model": st.hello.model}
    assert reg.get_sample_value("kvscope_engine_unfinished_requests", lv) is None  # active
    pt.hub.presence[st.hello.session].last_step = time.monotonic() - 3600  # steps long ago
    beat = wire.Frame(engine=st.engine, session=st.hello.session, first_seq=pt.rec.seq,
                      dropped=0, faults=0, records=[wire.Heartbeat(
                          ts=time.time(), since_step_s=3600.0, unfinished=unfinished(sched))])
    assert pt.hub.accept(wire.encode(beat))
    assert reg.get_sample_value("kvscope_probe_state", {**lv, "state": "idle"}) == 1
    assert reg.get_sample_value("vllm_scheduler_running_requests", lv) == 3
    assert reg.get_sample_value("kvscope_engine_unfinished_requests", lv) == 0
