"""The probe never changes what vLLM does, never raises into it, and gives up cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin
from kvscope_probe.recorder import MAX_FAULTS, Recorder

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin

SPEC = WorkloadSpec(n_requests=60, seed=3)


def run(rec_factory: object = None) -> tuple[object, Recorder | None]:
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    rec = None
    if rec_factory is not None:
        rec = rec_factory(twin.scheduler)  # type: ignore[operator]
        plugin.bind(twin.scheduler, rec)
    result = twin.run(generate(SPEC))
    return result, rec


def plain_recorder(sched: object) -> Recorder:
    return Recorder(sched, ring_size=1 << 20, keyframe_interval_s=3600)


def test_faults_in_every_hook_are_contained_and_change_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    baseline, _ = run(plain_recorder)
    calls = {"n": 0}

    def boom(*_a: object, **_k: object) -> None:
        calls["n"] += 1
        raise RuntimeError("injected")

    for name in ("on_alloc", "on_free", "on_preempt", "on_arrival", "on_end", "on_step"):
        monkeypatch.setattr(Recorder, name, boom)
    faulty, rec = run(plain_recorder)
    assert rec is not None
    assert (faulty.steps, faulty.preemptions, faulty.finished) == (  # type: ignore[attr-defined]
        baseline.steps, baseline.preemptions, baseline.finished)  # type: ignore[attr-defined]
    assert rec.faults == min(calls["n"], MAX_FAULTS) or rec.faults >= MAX_FAULTS
    assert not rec.enabled  # after MAX_FAULTS contained errors it switched itself off
    assert calls["n"] >= MAX_FAULTS


def test_no_sidecar_listening_drops_and_counts_without_blocking(tmp_path: object) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    assert plugin.enable(endpoint)
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    t0 = time.perf_counter()
    result = twin.run(generate(SPEC))
    elapsed = time.perf_counter() - t0
    rec = twin.scheduler._kvscope
    plugin.stop_all()
    assert result.finished == SPEC.n_requests
    assert rec.enabled and rec.faults == 0
    assert rec.seq > result.steps  # a record per step, plus hello and keyframes
    assert rec.send_dropped + rec.ring_dropped == rec.seq  # nothing could be delivered
    assert elapsed < 60  # sanity bound only; benchmarks measure cost


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
