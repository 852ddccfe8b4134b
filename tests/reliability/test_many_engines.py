"""Eight engine processes on one sidecar, over tcp with CURVE: every engine exact, idle
engines healthy, a killed one gone and a frozen one silent, each detected and named.

Each engine is a process of its own (``twinworker``): vLLM's real scheduler with the probe
attached by the plugin and a real Sender, like an EngineCore. They form three "servers":
twin-a with DP ranks 0-3 (the index set as vLLM's DP EngineCore sets it, the rank left 0),
twin-b with ranks 0-1, and twin-c twice with rank 0: two live processes claiming one
identity, which must be kept apart and reported, never merged.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvscope.localvllm.server import free_port
from tests.reliability.serveproc import ROOT, ServeProcess, clean_env, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.twin]
pytest.importorskip("kvscope.twin.engine")

SECRET = "many-engines-secret-0123456789abcdef"
TIMEOUT_S = 4.0
ENGINES = [("twin-a:8000", 0), ("twin-a:8000", 1), ("twin-a:8000", 2), ("twin-a:8000", 3),
           ("twin-b:8000", 0), ("twin-b:8000", 1), ("twin-c:8000", 0), ("twin-c:8000", 0)]
N_REQUESTS = 40


def start_worker(i: int, endpoint: str, server: str, dp: int) -> subprocess.Popen[str]:
    env = clean_env(KVSCOPE_PROBE_ENDPOINT=endpoint, KVSCOPE_PROBE_SECRET=SECRET,
                    KVSCOPE_SERVER=server, KVSCOPE_PROBE_RING=str(1 << 20),
                    VLLM_LOGGING_LEVEL="ERROR", PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.twinworker", str(dp), str(11 + i),
         str(N_REQUESTS)], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True)


def read_truths(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[dict[str, Any]]:
    """Each worker's JSON line (the truth of its pool), waiting for all of them at once."""
    sel = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        assert p.stdout is not None
        sel.register(p.stdout, selectors.EVENT_READ, i)
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(procs):
        left = deadline - time.monotonic()
        assert left > 0, f"workers {sorted(set(range(len(procs))) - set(out))} said nothing"
        for key, _ in sel.select(left):
            line = key.fileobj.readline()  # type: ignore[union-attr]
            assert line, f"worker {key.data} exited with {procs[key.data].wait()}"
            out[key.data] = json.loads(line)
            sel.unregister(key.fileobj)
    return [out[i] for i in range(len(procs))]


def by_session(side: ServeProcess) -> dict[str, dict[str, Any]]:
    return {e["session"]: e for e in side.engines()}


def readyz(side: ServeProcess) -> tuple[int, dict[str, Any]]:
    r = side.get("/readyz")
    return r.status_code, r.json()


def exact(e: dict[str, Any] | None, t: dict[str, Any]) -> bool:
    return bool(e) and e["synced"] and e["steps"] == t["steps"] \
        and sum(e["preemptions"].values()) == t["preemptions"] \
        and e["free_blocks"] == t["free_blocks"] \
        and sum(e["requests_ended"].values()) == t["requests"] == e["requests_arrived"]


@contextmanager
def eight_engines(tmp_path: Path) -> Iterator[tuple[ServeProcess, list[subprocess.Popen[str]],
                                                    list[dict[str, Any]]]]:
    """A sidecar over tcp with CURVE and the eight workers of ``ENGINES`` on it, each done
    with its requests: (sidecar, worker processes, each worker's truth). On leaving, frozen
    workers are thawed, all are told to exit, and the sidecar is stopped."""
    secret_file = tmp_path / "probe.secret"
    secret_file.write_text(SECRET + "\n")
    os.chmod(secret_file, 0o600)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    side = ServeProcess(tmp_path / "side", endpoint=endpoint,
                        args=["--health-timeout", str(TIMEOUT_S), "--log-level", "info"],
                        env={"KVSCOPE_PROBE_SECRET_FILE": str(secret_file)})
    procs: list[subprocess.Popen[str]] = []
    try:
        side.start()
        procs = [start_worker(i, endpoint, s, dp) for i, (s, dp) in enumerate(ENGINES)]
        yield side, procs, read_truths(procs, 300)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                assert p.stdin is not None
                p.stdin.close()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        side.stop()


def assert_every_engine_exact(side: ServeProcess,
                              truths: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every engine's figures equal its pool, each under its own identity; the two claims
    of twin-c:8000/0 kept apart. Returns the engines by session."""
    wait_until("every engine's figures to equal its pool",
               lambda: all(exact(by_session(side).get(t["session"]), t) for t in truths),
               60)
    engines = by_session(side)
    keys = sorted(e["key"] for e in engines.values())
    (second,) = [t for t in truths if t["server"] == "twin-c:8000"
                 and engines[t["session"]]["key"] != "twin-c:8000/0"]  # the newer claim
    assert keys == sorted([f"twin-a:8000/{i}" for i in range(4)]
                          + ["twin-b:8000/0", "twin-b:8000/1", "twin-c:8000/0",
                             f"twin-c:8000#{second['pid']}/0"])
    for t, (server, dp) in zip(truths, ENGINES, strict=True):
        e = engines[t["session"]]
        assert (t["server"], t["engine"], t["dp_rank"]) == (server, str(dp), dp)
        assert (e["engine"], e["dp_rank"], e["pid"]) == (str(dp), dp, t["pid"])
        assert e["ledger_gaps"] == 0 and e["ledger_mismatches"] == 0
        assert e["probe_records_dropped"] == 0
    return engines


def assert_the_collision_is_reported(side: ServeProcess) -> None:
    collisions = side.get("/api/engines").json()["identity_collisions"]
    assert collisions == [{"server": "twin-c:8000", "engine": "0", "count": 1}]
    assert side.value("kvscope_engine_identity_collisions_total",
                      server="twin-c:8000", engine="0") == 1
    assert "two live probes claim server 'twin-c:8000' engine '0'" in side.stderr()


def assert_prometheus_preemptions_exact(side: ServeProcess, truths: list[dict[str, Any]],
                                        engines: dict[str, dict[str, Any]]) -> None:
    for t in truths:
        e = engines[t["session"]]
        got = sum(side.value("vllm_scheduler_preempted_requests_total", server=e["server"],
                             engine=e["engine"], model="twin", reason=r) or 0
                  for r in ("kv_full", "priority", "unknown"))
        assert got == t["preemptions"], e["key"]
    print("\nper-engine preemptions (sidecar == pool): " + ", ".join(
        f"{engines[t['session']]['key']}={t['preemptions']}" for t in truths))


def assert_idle_engines_stay_ready(side: ServeProcess) -> None:
    """Idle for longer than the health timeout: heartbeats keep every engine connected."""
    time.sleep(3 * TIMEOUT_S)
    code, body = readyz(side)
    assert code == 200 and body["status"] == "ok", body
    assert sorted(e["state"] for e in body["engines"]) == ["idle"] * 8
    assert all(e["heartbeats"] >= 2 for e in body["engines"])
    assert all(side.value("kvscope_probe_connected", server=e["server"],
                          engine=e["engine"], model="twin") == 1 for e in body["engines"])


def state_of(side: ServeProcess, key: str) -> str | None:
    return next((e["state"] for e in readyz(side)[1]["engines"] if e["key"] == key), None)


def kill_reads_gone(side: ServeProcess, proc: subprocess.Popen[str], key: str) -> float:
    """SIGKILL the engine process: it reads gone (same host, PID checked) and the sidecar
    stays ready. Returns the seconds it took."""
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    wait_until("the killed engine to read gone", lambda: state_of(side, key) == "gone",
               10, every_s=0.05)
    gone_s = time.monotonic() - t0
    code, body = readyz(side)
    assert code == 200, body  # gone is not silent; seven engines are connected
    return gone_s


def freeze_reads_silent(side: ServeProcess, proc: subprocess.Popen[str],
                        frozen: dict[str, Any]) -> float:
    """SIGSTOP the engine process (its probe stops, the process lives): it reads silent and
    the sidecar not ready, until SIGCONT makes it idle again. Returns the seconds to silent."""
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGSTOP)
    wait_until("the frozen engine to read silent",
               lambda: state_of(side, frozen["key"]) == "silent", 10 * TIMEOUT_S, every_s=0.05)
    silent_s = time.monotonic() - t0
    code, body = readyz(side)
    assert code == 503 and body["status"] == "probe silent"
    assert side.value("kvscope_probe_state", server=frozen["server"],
                      engine=frozen["engine"], model="twin", state="silent") == 1
    os.kill(proc.pid, signal.SIGCONT)
    wait_until("the thawed engine to be idle again",
               lambda: state_of(side, frozen["key"]) == "idle", 10 * TIMEOUT_S, every_s=0.05)
    assert readyz(side)[0] == 200
    return silent_s


def assert_clickhouse_rows_per_engine(side: ServeProcess, truths: list[dict[str, Any]],
                                      engines: dict[str, dict[str, Any]]) -> None:
    """One trace per request in ClickHouse, with the preemptions each engine had."""
    done = subprocess.run(
        [sys.executable, "-m", "kvscope", "query", "preemption_cost", "--format", "json",
         "--dsn", f"chdb://{side.data_dir / 'chdb'}"], cwd=ROOT, env=clean_env(),
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {(r["server"], r["engine"]): r for r in json.loads(done.stdout)}
    assert len(rows) == 8
    for t in truths:
        e = engines[t["session"]]
        row = rows[(e["server"], e["engine"])]
        assert (row["requests"], row["preemptions"]) == (t["requests"], t["preemptions"])


def test_eight_engines_on_one_sidecar_each_exact(tmp_path: Path) -> None:
    with eight_engines(tmp_path) as (side, procs, truths):
        lost = [(t["server"], t["engine"], t["records"], t["sent"], t["dropped"], t["faults"])
                for t in truths if t["dropped"] or t["faults"]]
        assert lost == [], "(server, engine, records, sent, dropped, faults) of each probe " \
            "that dropped records or contained a fault"
        engines = assert_every_engine_exact(side, truths)
        assert_the_collision_is_reported(side)
        assert_prometheus_preemptions_exact(side, truths, engines)
        assert_idle_engines_stay_ready(side)
        gone_s = kill_reads_gone(side, procs[0], engines[truths[0]["session"]]["key"])
        silent_s = freeze_reads_silent(side, procs[4], engines[truths[4]["session"]])
        print(f"killed engine read gone after {gone_s:.2f} s; frozen engine read silent after "
              f"{silent_s:.2f} s (health timeout {TIMEOUT_S:.0f} s, heartbeats every 2 s)")
    assert_clickhouse_rows_per_engine(side, truths, engines)  # the sidecar has stopped
