"""vLLM's one-GPU shape on the CPU: the model runner inside the EngineCore process.

On one GPU vLLM's default executor runs the model runner in the process that schedules,
and the runner keeps and extends in place the block-ID lists of each ``SchedulerOutput``
(``req_state.block_ids = new_req_data.block_ids``). ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
gives the CPU build the same shape. A probe that read a step's lists after ``schedule()``
returned saw them changed: ledger mismatches at keyframes. The probe must copy what it
needs on the engine thread.

Its own server (the shared one of ``conftest`` runs the worker in its own process), with
keyframes five times a second so that any drift of a block table shows at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.localvllm.server import HOST, ServerSpec, VllmServer, free_port
from tests.engine.conftest import EngineStack, SidecarProcess, running_stack
from tests.engine.figures import (
    ENGINE,
    REASONS,
    assert_audit_clean,
    sample,
    wait_until_quiet,
)

pytestmark = pytest.mark.engine

NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def inproc_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[EngineStack]:
    workdir = tmp_path_factory.mktemp("inproc")
    endpoint = f"ipc://{workdir}/probe.sock"
    port = free_port()
    sidecar = SidecarProcess(endpoint, free_port(), f"http://{HOST}:{port}", workdir)
    spec = ServerSpec(tiny_model_dir, port, num_gpu_blocks=NUM_BLOCKS, extra_env={
        "KVSCOPE_PROBE_ENDPOINT": endpoint,
        "KVSCOPE_PROBE_KEYFRAME_S": "0.2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    })
    with running_stack(VllmServer(spec, log_path=workdir / "vllm.log"), sidecar,
                       NUM_BLOCKS) as stack:
        yield stack


def test_ledger_stays_exact_with_the_model_runner_in_the_engine_process(
        inproc_stack: EngineStack) -> None:
    # Long prompts over a 512-token budget: chunked prefills, whose block lists the model
    # runner extends in place on the following steps.
    result = run_load_sync(inproc_stack.vllm.url, LoadSpec(n_requests=60, concurrency=24,
                                                           seed=11, short_fraction=0.5))
    assert result.error_count == 0 and result.ok == 60, result.errors
    vllm_text, side_text = wait_until_quiet(inproc_stack)
    vllm_pre = sample(vllm_text, "vllm:num_preemptions_total", ENGINE)
    ours = sum(sample(side_text, "vllm_scheduler_preempted_requests_total",
                      {**ENGINE, "reason": r}) for r in REASONS)
    assert vllm_pre > 0 and ours == vllm_pre
    assert sample(side_text, "kvscope_ledger_mismatches_total", ENGINE) == 0
    assert_audit_clean(side_text, ENGINE)
    assert sample(side_text, "kvscope_ledger_synced", ENGINE) == 1
    free = sample(side_text, "vllm_scheduler_free_blocks", ENGINE)
    usage = sample(vllm_text, "vllm:kv_cache_usage_perc", ENGINE)
    assert free == round((1 - usage) * (NUM_BLOCKS - 1)) == NUM_BLOCKS - 1
