"""kvscope.localvllm without a vLLM server: argv, ports, request mix, process lifecycle."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvscope.load.mix import (
    WORDS,
    LoadSpec,
    RequestOutcome,
    build_requests,
    request_headers,
    run_load_sync,
)
from kvscope.localvllm import server as server_mod
from kvscope.localvllm.server import (
    NICE_ENV,
    ServerExited,
    ServerSpec,
    VllmServer,
    command,
    default_nice,
    free_port,
    live_group_pids,
)
from tests.conftest import SUITE_VLLM_NICE


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_command_binds_loopback_and_passes_the_pool_shape() -> None:
    spec = ServerSpec(model_dir=Path("/models/tiny"), port=8123, num_gpu_blocks=64,
                      scheduling_policy="priority", extra_args=("--enable-log-requests",),
                      nice=0)
    argv = command(spec)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8123"
    assert flag_value(argv, "--model") == "/models/tiny"
    assert flag_value(argv, "--served-model-name") == "tiny"
    assert flag_value(argv, "--dtype") == "float32"
    assert "--enforce-eager" in argv
    assert flag_value(argv, "--block-size") == "32"
    assert flag_value(argv, "--num-gpu-blocks-override") == "64"
    assert flag_value(argv, "--kv-cache-memory-bytes") == str(64 * 1024 * 1024)
    assert flag_value(argv, "--max-model-len") == "1024"
    assert flag_value(argv, "--max-num-seqs") == "32"
    assert flag_value(argv, "--max-num-batched-tokens") == "512"
    assert flag_value(argv, "--scheduling-policy") == "priority"
    assert argv[-1] == "--enable-log-requests"


def test_a_niced_server_runs_behind_nice_with_its_own_argv() -> None:
    plain = ServerSpec(model_dir=Path("/models/tiny"), port=8123, nice=0)
    niced = ServerSpec(model_dir=Path("/models/tiny"), port=8123, nice=7)
    assert command(niced) == ["nice", "-n", "7", *command(plain)]


def test_the_default_niceness_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv(NICE_ENV, "12")
    assert ServerSpec(model_dir=Path("m"), port=1).nice == 12
    assert default_nice({}) == 0
    assert default_nice({NICE_ENV: " 3 "}) == 3
    with pytest.raises(ValueError, match=f"{NICE_ENV} must be an integer in 0..19, got 'x'"):
        default_nice({NICE_ENV: "x"})
    with pytest.raises(ValueError, match="nice must be in 0..19, got 20"):
        ServerSpec(model_dir=Path("m"), port=1, nice=20)


def test_the_suite_starts_its_vllm_servers_niced() -> None:
    """tests/conftest.py: vLLM takes both cores of a 2-core machine while it generates."""
    assert ServerSpec(model_dir=Path("m"), port=1).nice == SUITE_VLLM_NICE > 0


def test_server_spec_reports_every_error_at_once() -> None:
    with pytest.raises(ValueError) as info:
        ServerSpec(model_dir=Path("m"), port=0, block_size=48, max_num_seqs=0)
    message = str(info.value)
    assert "port" in message and "block_size" in message and "max_num_seqs" in message


def test_free_port_is_bindable_on_loopback() -> None:
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_never_hands_out_a_port_twice() -> None:
    """A test that asks for two ports before binding either must get two: CI once gave a
    sidecar the same port for its probe endpoint and its HTTP server."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_build_requests_is_deterministic_per_seed() -> None:
    spec = LoadSpec(n_requests=50, seed=7)
    assert build_requests(spec) == build_requests(LoadSpec(n_requests=50, seed=7))
    assert build_requests(spec) != build_requests(LoadSpec(n_requests=50, seed=8))


def test_build_requests_follows_the_mix() -> None:
    spec = LoadSpec(n_requests=400, seed=1)
    bodies = build_requests(spec)
    assert len(bodies) == 400
    vocabulary = set(WORDS)
    lengths = []
    for body in bodies:
        words = body["prompt"].split()
        assert set(words) <= vocabulary
        assert 32 <= body["max_tokens"] <= 256
        assert body["ignore_eos"] is True and body["temperature"] == 0.8
        assert body["model"] == "tiny" and "priority" not in body
        lengths.append(len(words))
    short = sum(1 for n in lengths if n <= 48)
    assert 0.6 < short / len(bodies) < 0.8
    assert all(8 <= n <= 48 or 300 <= n <= 700 + 256 for n in lengths)
    prefixed = [b for b in bodies if len(b["prompt"].split()) > 700]
    prefixes = {" ".join(b["prompt"].split()[:256]) for b in prefixed}
    assert prefixed and len(prefixes) == 1


def test_build_requests_adds_priority_only_when_asked() -> None:
    bodies = build_requests(LoadSpec(n_requests=40, priority=(-1, 2)))
    assert {b["priority"] for b in bodies} <= {-1, 0, 1, 2}


def test_request_headers_default_and_override() -> None:
    assert request_headers(LoadSpec(seed=3), 5)["X-Request-Id"] == "kvs-3-5"
    overridden = request_headers(LoadSpec(headers={"x-request-id": "mine", "X-A": "b"}), 5)
    assert overridden.get_list("X-Request-Id") == ["mine"]
    assert overridden["x-a"] == "b"


def test_load_spec_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError, match="concurrency.*max_tokens"):
        LoadSpec(concurrency=0, max_tokens=(10, 5))


def test_run_load_is_bounded_by_its_deadline() -> None:
    """A listener that never answers: every request must end as an error, on time."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        done: list[RequestOutcome] = []
        spec = LoadSpec(n_requests=12, concurrency=4, timeout_s=0.5)
        result = run_load_sync(url, spec, on_done=done.append)
    assert result.requests == 12 and result.ok == 0 and result.error_count == 12
    assert len(result.errors) == 5
    assert result.elapsed_s < 5
    assert sorted(o.index for o in done) == list(range(12))
    assert [o.index for o in result.outcomes] == list(range(12))


# A stand-in for the vLLM API server process: answers /health and /v1/models on loopback.
FAKE_VLLM = """
import http.server, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"data": [{"id": "tiny"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""

# A stand-in for a server that ignores SIGTERM and leaves a child in its process group.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c",
                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)"])
print("ready", flush=True)
time.sleep(600)
"""


def fake_command(script: str) -> Callable[[ServerSpec], list[str]]:
    def argv(spec: ServerSpec) -> list[str]:
        return [sys.executable, "-c", script, str(spec.port)]
    return argv


def spec_for(tmp_path: Path) -> ServerSpec:
    return ServerSpec(model_dir=tmp_path, port=free_port())


def test_context_manager_waits_for_readiness_and_cleans_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "command", fake_command(FAKE_VLLM))
    with VllmServer(spec_for(tmp_path), log_path=tmp_path / "log") as server:
        assert server.startup_s is not None and server.startup_s < 30
        assert server.url.startswith("http://127.0.0.1:")
        pgid = server.pid
        assert live_group_pids(pgid) == [pgid]
    assert live_group_pids(pgid) == []


def test_wait_ready_fails_fast_with_the_log_tail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "command",
                        fake_command("import sys; print('no model here'); sys.exit(3)"))
    server = VllmServer(spec_for(tmp_path), log_path=tmp_path / "log")
    started = time.monotonic()
    with pytest.raises(ServerExited, match="(?s)code 3.*no model here"):
        with server:
            pass
    assert time.monotonic() - started < 30


def test_stop_kills_a_group_that_ignores_sigterm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_mod, "command", fake_command(STUBBORN))
    server = VllmServer(spec_for(tmp_path), log_path=tmp_path / "log")
    server.start()
    deadline = time.monotonic() + 30
    while "ready" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(live_group_pids(server.pid)) == 2
    assert server.stop(timeout_s=1.0) == -9
    assert live_group_pids(server.pid) == []
    assert server.stop() == -9  # idempotent
