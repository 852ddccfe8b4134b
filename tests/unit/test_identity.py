"""An engine's identity: which vLLM server (from the argv the EngineCore inherits) and
which data-parallel index, stable by default and overridable."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from kvscope_probe import identity

MODULE = "/venv/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py"


@pytest.mark.parametrize(("argv", "want"), [
    ([MODULE, "--model", "m", "--host", "127.0.0.1", "--port", "8011"], "127.0.0.1:8011"),
    ([MODULE, "--model=m", "--host=10.0.0.7", "--port=9000"], "10.0.0.7:9000"),
    (["/usr/local/bin/vllm", "serve", "Qwen/Qwen2.5", "--port", "8001"], "box:8001"),
    (["vllm", "serve", "m", "--host", "0.0.0.0"], "box:8000"),
    (["vllm", "serve", "m", "--host", "::", "--port", "1"], "box:1"),
    (["vllm", "serve", "m", "--uds", "/run/vllm.sock"], "/run/vllm.sock"),
    ([MODULE, "--port", "1", "--port", "2"], "box:2"),  # argparse: the last one wins
    (["pytest", "tests/twin", "--port", "9"], ""),  # not an API server: no server
    (["vllm", "bench", "--port", "9"], ""),
    ([], ""),
])
def test_the_api_server_address_comes_from_argv(argv: list[str], want: str) -> None:
    assert identity.api_server_address(argv, hostname="box") == want


def test_a_name_the_user_sets_wins_and_labels_stay_bounded() -> None:
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=3,
                                                          data_parallel_rank=0))
    argv = [MODULE, "--host", "127.0.0.1", "--port", "8011"]
    default = identity.engine_identity(cfg, env={}, argv=argv)
    assert (default.server, default.engine, default.dp_rank) == ("127.0.0.1:8011", "3", 3)
    env = {"KVSCOPE_SERVER": "gpu-a", "KVSCOPE_ENGINE": "x" * 99}
    named = identity.engine_identity(cfg, env=env, argv=argv)
    assert (named.server, named.engine) == ("gpu-a", "x" * identity.MAX_LABEL)


def test_the_dp_index_is_used_where_vllm_has_it() -> None:
    # Dense-model DP ranks all have data_parallel_rank 0 (vLLM resets it); the index is real.
    assert identity.data_parallel_index(
        SimpleNamespace(data_parallel_index=5, data_parallel_rank=0)) == 5
    assert identity.data_parallel_index(SimpleNamespace(data_parallel_rank=2)) == 2
    assert identity.data_parallel_index(None) == -1


def test_engine_keys() -> None:
    assert identity.engine_key("127.0.0.1:8000", "0") == "127.0.0.1:8000/0"
    assert identity.engine_key("", "0") == "0"


def test_process_start_time_is_what_psutil_reads() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        ours = identity.process_start_time(child.pid)
        assert abs(ours - psutil.Process(child.pid).create_time()) < 0.05
        assert abs(identity.process_start_time() - psutil.Process(os.getpid()).create_time()) < 0.05
    finally:
        child.kill()
        child.wait()
    assert identity.process_start_time(child.pid) == 0.0  # reaped: unknown


def test_the_default_host_is_this_machine() -> None:
    assert identity.api_server_address(["vllm", "serve", "m"]) == f"{socket.gethostname()}:8000"
