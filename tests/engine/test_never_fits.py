"""A pool that cannot hold one max_model_len request, on the real vLLM CPU server.

vLLM #39734 and #35541 describe a request longer than the KV pool (but within
``max_model_len``) hanging at the head of the waiting queue. vLLM 0.32 (the CPU build)
refuses to start such a server instead: with ``--num-gpu-blocks-override 8`` (7 usable
blocks of 32 tokens = 224 tokens) and ``--max-model-len 1024`` its start-up check raises
before the scheduler, and so kvscope's probe, exists; no request can ever reach a queue it
could not leave. This test pins that behaviour (it fails the day vLLM lets such a server
start, and then the never-fits path of ``kvscope.state.capacity`` is live: see
tests/unit/test_capacity.py and tests/twin/test_never_fits.py), and that the sidecar
invents no engine for the server that never started.

This module starts its own server (and sidecar) under the machine-wide vLLM lock.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvscope.localvllm.server import HOST, ServerExited, ServerSpec, VllmServer, free_port
from tests.engine.conftest import SidecarProcess, running_stack

pytestmark = pytest.mark.engine

NUM_BLOCKS = 8
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024


def test_vllm_refuses_to_start_with_a_pool_shorter_than_max_model_len(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/probe.sock"
    port = free_port()
    sidecar = SidecarProcess(endpoint, free_port(), f"http://{HOST}:{port}", tmp_path)
    spec = ServerSpec(tiny_model_dir, port, block_size=BLOCK_SIZE, num_gpu_blocks=NUM_BLOCKS,
                      max_model_len=MAX_MODEL_LEN,
                      extra_env={"KVSCOPE_PROBE_ENDPOINT": endpoint})
    server = VllmServer(spec, log_path=tmp_path / "vllm.log")
    with running_stack(server, sidecar, NUM_BLOCKS, wait=False):
        with pytest.raises(ServerExited):
            server.wait_ready(timeout_s=180.0)
        log = (tmp_path / "vllm.log").read_text(errors="replace")
        usable_tokens = (NUM_BLOCKS - 1) * BLOCK_SIZE
        assert (f"To serve at least one request with the model's max seq len "
                f"({MAX_MODEL_LEN})") in log
        assert f"the estimated maximum model length is {usable_tokens}." in log
        layout = httpx.get(f"{sidecar.url}/api/layout", timeout=5.0, trust_env=False).json()
        assert layout["engines"] == []
