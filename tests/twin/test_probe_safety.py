"""The probe never changes what vLLM does, never raises into it, and gives up cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin
from kvscope_probe.recorder import MAX_FAULTS, Recorder
from tests.twin.exactness import step_trail
from tests.twin.waits import threads_that_wait

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin

SPEC = WorkloadSpec(n_requests=60, seed=3)


def run(rec_factory: object = None,
        endpoint: str | None = None) -> tuple[object, Recorder | None, list[object]]:
    """One run of SPEC; ``rec_factory`` binds a Recorder, none leaves the hooks inert
    (vLLM unprobed). Returns the result, the recorder and the step trail."""
    assert plugin.enable(endpoint)
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    rec = None
    if rec_factory is not None:
        rec = rec_factory(twin.scheduler)  # type: ignore[operator]
        plugin.bind(twin.scheduler, rec)
    trail, on_step = step_trail(twin)
    result = twin.run(generate(SPEC), on_step=on_step)
    if endpoint is not None:
        rec = twin.scheduler._kvscope
    return result, rec, trail


def plain_recorder(sched: object) -> Recorder:
    return Recorder(sched, ring_size=1 << 20, keyframe_interval_s=3600)


HANDLERS = ("on_alloc", "on_free", "on_preempt", "on_arrival", "on_end", "on_step")


def test_faults_in_every_hook_are_contained_and_change_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unprobed, _, base_trail = run()
    calls = dict.fromkeys(HANDLERS, 0)

    def failing(name: str) -> object:
        def boom(*_a: object, **_k: object) -> None:
            calls[name] += 1
            raise RuntimeError(f"injected in {name}")
        return boom

    for name in HANDLERS:
        monkeypatch.setattr(Recorder, name, failing(name))
    faulty, rec, trail = run(plain_recorder)
    assert rec is not None
    # vLLM did, step for step, what it does without the probe
    assert faulty.steps == unprobed.steps and len(trail) == len(base_trail)  # type: ignore[attr-defined]
    assert trail == base_trail
    # every handler call raised and was counted, one fault each, until the MAX_FAULTS-th
    # switched recording off; from then on no handler ran
    assert rec.faults == sum(calls.values()) == MAX_FAULTS
    assert not rec.enabled
    # the faults came from handlers on both sides of vLLM's calls, not from one
    assert {"on_arrival", "on_step"} <= {n for n, c in calls.items() if c}, calls


def test_no_sidecar_listening_drops_and_counts_without_blocking(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing that can wait (opening, connecting, sending) runs on the engine thread, and
    the run is step for step the unprobed one."""
    unprobed, _, base_trail = run()
    waits = threads_that_wait(monkeypatch)
    engine_thread = threading.current_thread().name
    result, rec, trail = run(endpoint=f"ipc://{tmp_path}/nobody.sock")
    senders = list(plugin._senders)
    plugin.stop_all()
    # stop_all waits 5 s at most; a sender with nobody to send to waits 1 s for a
    # connection, then up to 200 ms for each batch it cannot send, and counts what is
    # left when it ends: on a loaded machine that outlasted the 5 s once (640 of 1,987
    # records counted). The count is complete when the sender has ended, as it must.
    for s in senders:
        s.join(60.0)
        assert not s.is_alive()
    assert rec is not None
    assert result.finished == SPEC.n_requests  # type: ignore[attr-defined]
    assert trail == base_trail
    assert rec.enabled and rec.faults == 0
    assert rec.seq > result.steps  # type: ignore[attr-defined]  # a record per step, plus hello and keyframes
    assert rec.send_dropped + rec.ring_dropped == rec.seq  # nothing could be delivered
    assert set(waits) >= {"push_socket", "send"}, waits  # the sender tried, on its thread
    assert all(engine_thread not in threads for threads in waits.values()), waits


def test_an_incompatible_vllm_disables_the_probe_with_one_log_line(tmp_path: object) -> None:
    code = textwrap.dedent(f"""
        import logging, os
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        os.environ["KVSCOPE_PROBE_ENDPOINT"] = "ipc://{tmp_path}/p.sock"
        from kvscope_probe import hooks, plugin
        hooks.REQUIRED["vllm.v1.core.block_pool:BlockPool"] += ("allocate_contiguous",)
        from vllm.v1.core.sched.scheduler import Scheduler
        original = Scheduler.schedule
        plugin.register()
        print("PATCHED" if Scheduler.schedule is not original else "UNTOUCHED")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={"VLLM_LOGGING_LEVEL": "ERROR", "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "UNTOUCHED" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("kvscope_probe")]
    assert len(lines) == 1 and "BlockPool.allocate_contiguous" in lines[0], out.stderr[-2000:]


def test_without_the_endpoint_variable_register_does_nothing() -> None:
    code = ("import os; os.environ.pop('KVSCOPE_PROBE_ENDPOINT', None)\n"
            "from kvscope_probe import plugin; plugin.register()\n"
            "import sys; print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"  # not even imported
