"""Two real vLLM CPU servers on one sidecar (issue 11): distinct identities by default,
exact per-engine counts against each server's own ``vllm:num_preemptions_total``, ``layout
dump --pid`` from any process of a server's tree, an idle night that stays ready, and a
killed EngineCore detected and named.

Both servers run at once (the issue's shape), so the machine-wide vLLM lock is held once
around the whole module; the servers are the small ones the other engine tests use, and no
KVSCOPE_SERVER or KVSCOPE_ENGINE is set: the identity must come from vLLM itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.localvllm.server import ServerSpec, VllmServer, free_port, live_group_pids
from tests.engine.conftest import NUM_BLOCKS, vllm_machine_lock
from tests.reliability.serveproc import ROOT, ServeProcess, clean_env, wait_until

pytestmark = pytest.mark.engine

TIMEOUT_S = 5.0
REASONS = ("kv_full", "priority", "unknown")


@dataclass
class Two:
    side: ServeProcess
    servers: list[VllmServer]

    def key(self, server: VllmServer) -> str:
        return f"127.0.0.1:{server.spec.port}/0"

    def engines(self) -> dict[str, dict[str, Any]]:
        return {e["key"]: e for e in self.side.engines()}


@pytest.fixture(scope="module")
def two(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Two]:
    workdir = tmp_path_factory.mktemp("two-servers")
    endpoint = f"ipc://{workdir}/probe.sock"
    side = ServeProcess(workdir / "side", endpoint=endpoint,
                        args=["--health-timeout", str(TIMEOUT_S), "--clickhouse-dsn", "off"])
    servers = [VllmServer(ServerSpec(tiny_model_dir, free_port(), num_gpu_blocks=NUM_BLOCKS,
                                     extra_env={"KVSCOPE_PROBE_ENDPOINT": endpoint}),
                          log_path=workdir / f"vllm-{i}.log") for i in range(2)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(vllm_machine_lock())  # released last, after everything stopped
        stack.callback(side.stop)
        side.start()
        for s in servers:
            stack.callback(s.stop)
            s.start()
        for s in servers:
            s.wait_ready()
        yield Two(side, servers)


def samples(text: str, name: str, **labels: str) -> list[float]:
    return [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def get(url: str) -> str:
    r = httpx.get(url, timeout=5.0, trust_env=False)
    r.raise_for_status()
    return r.text


def first_request(server: VllmServer) -> None:
    httpx.post(f"{server.url}/v1/completions", timeout=60.0, trust_env=False, json={
        "model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4}).raise_for_status()


def test_both_engines_are_ready_and_in_sync_before_any_request(two: Two) -> None:
    """The probe says hello (and sends a keyframe) when vLLM builds its scheduler, so an
    engine that has served nothing is ready, and its pool is known, before any traffic."""
    wait_until("both engines heard", lambda: len(two.engines()) == 2, 30)
    engines = two.engines()
    assert all(e["synced"] and e["steps"] == 0 for e in engines.values()), engines
    assert all(e["free_blocks"] == NUM_BLOCKS - 1 for e in engines.values()), engines
    r = two.side.get("/readyz")
    assert r.status_code == 200, r.text
    assert {e["key"] for e in r.json()["engines"]} == {two.key(s) for s in two.servers}


def test_each_server_is_its_own_engine_by_default(two: Two) -> None:
    for s in two.servers:
        first_request(s)
    wait_until("both engines synced", lambda: len(e := two.engines()) == 2
               and all(x["synced"] for x in e.values()), 60)
    engines = two.engines()
    assert sorted(engines) == sorted(two.key(s) for s in two.servers)
    for s in two.servers:
        e = engines[two.key(s)]
        assert (e["server"], e["engine"], e["dp_rank"]) == (f"127.0.0.1:{s.spec.port}", "0", 0)
        assert e["pid"] != s.pid and e["pid"] in live_group_pids(s.pid)  # its EngineCore
    assert two.side.get("/api/engines").json()["identity_collisions"] == []
    # vLLM's ipc sockets are in each server's own directory, not loose in the temp one
    for s in two.servers:
        assert s.rpc_dir is not None and any(p.is_socket() for p in s.rpc_dir.iterdir())


def test_per_engine_counts_equal_each_servers_own(two: Two) -> None:
    results: dict[int, Any] = {}

    def load(i: int) -> None:
        spec = LoadSpec(n_requests=80, concurrency=32, seed=20 + i)
        results[i] = run_load_sync(two.servers[i].url, spec)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(r.error_count == 0 and r.ok == 80 for r in results.values()), {
        i: (r.ok, r.error_count, r.errors) for i, r in results.items()}

    def settled() -> list[tuple[str, float, float, float, float]] | None:
        side = get(f"{two.side.url}/metrics")
        out = []
        for s in two.servers:
            text = get(f"{s.url}/metrics")
            server = f"127.0.0.1:{s.spec.port}"
            if (samples(text, "vllm:num_requests_running", engine="0") != [0.0]
                    or samples(text, "vllm:num_requests_waiting", engine="0") != [0.0]
                    or samples(side, "vllm_scheduler_running_requests", server=server) != [0.0]):
                return None
            ours = sum(samples(side, "vllm_scheduler_preempted_requests_total", server=server,
                               engine="0"))
            (theirs,) = samples(text, "vllm:num_preemptions_total", engine="0")
            (usage,) = samples(text, "vllm:kv_cache_usage_perc", engine="0")
            (free,) = samples(side, "vllm_scheduler_free_blocks", server=server, engine="0")
            out.append((server, ours, theirs, free, round((1 - usage) * (NUM_BLOCKS - 1))))
        return out if all(o[1] == o[2] and o[3] == o[4] for o in out) else None

    figures = wait_until("each engine's counts to equal its server's", settled, 60, 0.5)
    print("\nper-engine preemptions and free blocks (kvscope == vLLM): " + "; ".join(
        f"{srv}: preemptions {ours:.0f} == {theirs:.0f}, free {free:.0f} == {vf}"
        for srv, ours, theirs, free, vf in figures))
    assert all(ours > 0 for _, ours, *_ in figures)  # the load made each pool run out
    engines = two.engines()
    assert all(e["ledger_mismatches"] == 0 and e["probe_records_dropped"] == 0
               for e in engines.values())
    assert all(e["audit_blocks"] > 0 and not any(e["audit_mismatches"].values())
               for e in engines.values())


def dump_keys(url: str, pid: int) -> list[str]:
    """The engine keys ``kvscope layout dump --pid PID`` finds on the sidecar at ``url``."""
    done = subprocess.run(
        [sys.executable, "-m", "kvscope", "layout", "dump", "--output", "-", "--url",
         url, "--pid", str(pid), "--history", "0"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [e["key"] for e in json.loads(done.stdout)["engines"]]


def test_layout_dump_pid_takes_any_pid_of_the_server_tree(two: Two) -> None:
    for s in two.servers:
        engine_pid = two.engines()[two.key(s)]["pid"]
        workers = [c.pid for c in psutil.Process(engine_pid).children(recursive=True)]
        assert workers, "the CPU build runs its model runner in a worker process"
        for pid in (s.pid, engine_pid, workers[0]):
            assert dump_keys(two.side.url, pid) == [two.key(s)], pid


def test_idle_longer_than_the_health_timeout_stays_ready(two: Two) -> None:
    time.sleep(3 * TIMEOUT_S)
    r = two.side.get("/readyz")
    assert r.status_code == 200, r.text
    states = {e["key"]: e["state"] for e in r.json()["engines"]}
    assert states == {two.key(s): "idle" for s in two.servers}
    metrics = two.side.metrics()
    for s in two.servers:
        labels = {"server": f"127.0.0.1:{s.spec.port}", "engine": "0", "model": "tiny"}
        assert metrics[("kvscope_probe_connected", frozenset(labels.items()))] == 1
        assert httpx.get(f"{s.url}/health", timeout=5, trust_env=False).status_code == 200


def test_a_killed_engine_core_is_detected_as_gone(two: Two) -> None:
    victim, other = two.servers
    key = two.key(victim)
    pid = two.engines()[key]["pid"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def state() -> str | None:
        return {e["key"]: e["state"] for e in two.side.get("/readyz").json()["engines"]}[key]

    wait_until("the killed engine to read gone", lambda: state() == "gone", 30, 0.05)
    gone_s = time.monotonic() - t0
    r = two.side.get("/readyz")
    states = {e["key"]: e["state"] for e in r.json()["engines"]}
    assert r.status_code == 200 and states == {key: "gone", two.key(other): "idle"}
    labels = frozenset({"server": f"127.0.0.1:{victim.spec.port}", "engine": "0",
                        "model": "tiny", "state": "gone"}.items())
    assert two.side.metrics()[("kvscope_probe_state", labels)] == 1
    print(f"\nkilled EngineCore {pid}: the sidecar read it gone after {gone_s:.2f} s "
          f"(health timeout {TIMEOUT_S:.0f} s; PID checked on this host)")
    victim.stop()
    assert victim.rpc_dir is not None and not victim.rpc_dir.exists()  # its sockets went too
