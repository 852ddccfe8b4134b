"""A real vLLM CPU server serving a hybrid model: kvscope must stay exact on two KV groups.

The tiny Gemma 3 text model (``make_tiny_model(kind="gemma3")``: sliding-window and
full-attention layers interleaved, window 64 tokens) makes vLLM build two KV cache groups
over one block pool. Under a mixed load with random priorities and the priority policy,
kvscope's preemption count must equal vLLM's ``vllm:num_preemptions_total``, its free
blocks at idle must equal what vLLM's ``vllm:kv_cache_usage_perc`` implies, and the ledger
must never disagree with a keyframe, five of which arrive every second. Then, from the
stopped sidecar's store alone (``kvscope query engine_settings``), the twin is rebuilt from
the engine's hello and must build the very pool and KV cache groups the server built.

This module starts its own server (and sidecar) under the machine-wide vLLM lock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.localvllm.server import HOST, ServerSpec, VllmServer, free_port
from kvscope.models.config import default_cache_dir
from kvscope.models.tiny import make_tiny_model
from kvscope.whatif.engine_settings import from_config
from kvscope_probe.identity import hello
from tests.engine.conftest import EngineStack, SidecarProcess, running_stack
from tests.engine.figures import (
    ENGINE,
    REASONS,
    assert_audit_clean,
    sample,
    saved_query,
    wait_for_synced_engine,
    wait_until_quiet,
)

pytestmark = pytest.mark.engine

NUM_BLOCKS = 64
"""Both groups draw from these: a full-length request needs 32 full-attention blocks plus
the sliding-window group's share, so the mixed load preempts."""
KEYFRAME_S = "0.2"


@pytest.fixture(scope="module")
def hybrid_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineStack]:
    """ONE vLLM server serving the tiny Gemma 3, with the probe, and its sidecar."""
    model_dir = make_tiny_model(default_cache_dir() / "tiny-gemma3", kind="gemma3")
    workdir = tmp_path_factory.mktemp("hybrid")
    endpoint = f"ipc://{workdir}/probe.sock"
    vllm_port = free_port()
    sidecar = SidecarProcess(endpoint, free_port(), f"http://{HOST}:{vllm_port}", workdir)
    spec = ServerSpec(model_dir, vllm_port, num_gpu_blocks=NUM_BLOCKS,
                      scheduling_policy="priority",
                      extra_env={"KVSCOPE_PROBE_ENDPOINT": endpoint,
                                 "KVSCOPE_PROBE_KEYFRAME_S": KEYFRAME_S})
    with running_stack(VllmServer(spec, log_path=workdir / "vllm.log"), sidecar,
                       NUM_BLOCKS) as stack:
        yield stack


def test_two_kv_groups_and_exact_counts_under_a_priority_load(
        hybrid_stack: EngineStack, record_property: pytest.RecordProperty) -> None:
    stack = hybrid_stack
    first = httpx.post(f"{stack.vllm.url}/v1/completions", timeout=60.0, trust_env=False,
                       json={"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 8,
                             "ignore_eos": True})
    assert first.status_code == 200, first.text
    summary = wait_for_synced_engine(stack, timeout_s=30.0)
    assert summary["num_blocks"] == NUM_BLOCKS and summary["policy"] == "priority"
    layout = httpx.get(f"{stack.sidecar.url}/api/layout", timeout=5.0, trust_env=False).json()
    groups = [g["kind"] for g in layout["engines"][0]["kv_groups"]]
    assert sorted(groups) == ["FullAttentionSpec", "SlidingWindowSpec"], groups

    spec = LoadSpec(n_requests=120, concurrency=32, seed=5, priority=(0, 3))
    result = run_load_sync(stack.vllm.url, spec)
    assert result.ok == spec.n_requests, result.errors
    vllm_text, side_text = wait_until_quiet(stack)

    vllm_preemptions = sample(vllm_text, "vllm:num_preemptions_total", ENGINE)
    by_reason = {r: sample(side_text, "vllm_scheduler_preempted_requests_total",
                           {**ENGINE, "reason": r}) for r in REASONS}
    usage = sample(vllm_text, "vllm:kv_cache_usage_perc", ENGINE)
    vllm_free = round((1.0 - usage) * (NUM_BLOCKS - 1))
    side_free = sample(side_text, "vllm_scheduler_free_blocks", ENGINE)
    mismatches = sample(side_text, "kvscope_ledger_mismatches_total", ENGINE)
    figures = {"load_s": round(result.elapsed_s, 1), "preemptions_vllm": vllm_preemptions,
               "preemptions_kvscope": by_reason, "free_blocks_vllm": vllm_free,
               "free_blocks_kvscope": side_free, "ledger_mismatches": mismatches,
               "steps": sample(side_text, "vllm_scheduler_steps_total", ENGINE)}
    for name, value in figures.items():
        record_property(name, value)
    print(f"hybrid engine figures: {figures}")

    assert sample(side_text, "kvscope_probe_records_dropped_total", ENGINE) == 0
    assert sample(side_text, "kvscope_ledger_gaps_total", ENGINE) == 0
    assert sample(side_text, "kvscope_probe_faults_total", ENGINE) == 0
    assert sum(by_reason.values()) == vllm_preemptions > 0
    assert by_reason["unknown"] == 0
    assert side_free == vllm_free
    assert mismatches == 0
    assert_audit_clean(side_text, ENGINE)  # hybrid: vLLM's pool, sliding-window nulls too
    assert sample(side_text, "kvscope_ledger_synced", ENGINE) == 1

    # The twin rebuilt from the stored hello alone builds the server's pool and groups.
    stack.sidecar.stop()  # releases the embedded store
    (row,) = json.loads(saved_query(stack, "engine_settings"))
    assert row["kv_group_kinds"] == groups and row["num_blocks"] == NUM_BLOCKS
    got = from_config(row)
    from kvscope.twin.engine import Twin

    twin = hello(Twin(got.config()).scheduler)
    assert [[g.kind, g.block_size, g.sliding_window] for g in twin.kv_groups] == [
        list(g) for g in zip(row["kv_group_kinds"], row["kv_group_block_sizes"],
                             row["kv_group_windows"], strict=True)]
    assert (twin.num_blocks, twin.block_size, twin.max_num_seqs, twin.max_num_batched_tokens,
            twin.max_model_len, twin.policy, twin.prefix_caching) == (
        row["num_blocks"], row["block_size"], row["max_num_seqs"],
        row["max_num_batched_tokens"], row["max_model_len"], row["policy"],
        row["prefix_caching"])
    record_property("rebuilt_from_hello", got.spec)
