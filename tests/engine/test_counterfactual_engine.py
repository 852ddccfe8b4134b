"""``kvscope explain --counterfactual`` checked against the real engine under the alternative
it predicts for (issue 26).

A real vLLM engine (the offline ``LLM`` on the tiny model, the probe streaming to a real
sidecar with its embedded store) runs 24 long requests, all added before its first step, on
the API server's shape (48 blocks of 32 tokens, 32 seqs, 512-token budget): they preempt one
another. ``kvscope explain`` of the most preempted request, from the store alone, gates the
twin against what the engine did and predicts each alternative; the same requests then run on
a real engine with the "1.5x blocks" alternative's pool (72 blocks). Arrivals before the first
step are the one arrival order a real engine cannot change (an API server admits requests as
its event loop reaches them), so the prediction is checked for equality: the request's
preemptions and its latency in steps, and the same for every request of the window.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvscope.localvllm.server import HOST, QUIET_ENV, free_port
from kvscope.procs import stop_process
from kvscope.whatif.engine_settings import from_config
from kvscope.whatif.measure import measure
from kvscope.whatif.replay import load
from tests.engine.conftest import SidecarProcess, vllm_machine_lock

pytestmark = pytest.mark.engine
N, WORDS, MAX_TOKENS, BLOCKS = 24, 160, 600, 48
"""24 requests of ~190 prompt tokens and 600 output tokens (25 blocks each at the end) on
48 blocks: one runs alone by the end, the rest wait or are preempted (57 preemptions)."""
ALTERNATIVE = "1.5x blocks"
ALT_BLOCKS = BLOCKS + BLOCKS // 2


def engine_run(model_dir: Path, blocks: int, workdir: Path) -> dict[str, Any]:
    """The requests on a real engine of ``blocks`` blocks, recorded by a real sidecar; the
    sidecar stopped (its store flushed). Returns the engine's output and the store's DSN."""
    workdir.mkdir(parents=True)
    endpoint = f"ipc://{workdir}/probe.sock"
    sidecar = SidecarProcess(endpoint, free_port(), f"http://{HOST}:{free_port()}", workdir)
    env = {**os.environ, **QUIET_ENV, "KVSCOPE_PROBE_ENDPOINT": endpoint,
           "VLLM_LOGGING_LEVEL": "ERROR"}
    argv = [sys.executable, "-m", "tests.engine.offline_run", str(model_dir), str(blocks),
            str(N), str(WORDS), str(MAX_TOKENS), sidecar.url]
    with vllm_machine_lock():
        sidecar.start()
        try:
            with (workdir / "engine.log").open("wb") as log:
                proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env,
                                        start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=600)
            finally:
                stop_process(proc, 10, group=True)
            assert proc.returncode == 0, (workdir / "engine.log").read_text()[-3000:]
            ran = json.loads(out.decode().strip().splitlines()[-1])
            assert ran["ended"] == N, f"the sidecar saw {ran['ended']} of {N} requests end"
        finally:
            sidecar.stop()
    return {**ran, "dsn": f"chdb://{workdir / 'data' / 'chdb'}"}


def kvscope(*argv: str) -> str:
    return subprocess.run([sys.executable, "-m", "kvscope", *argv], capture_output=True,
                          text=True, timeout=300, check=True).stdout


def by_prompt(dsn: str) -> dict[str, dict[str, Any]]:
    """replay_traffic's records of the store, by the offline request ID ("5" of vLLM's
    "5-<random suffix>"), steps from the first arrival."""
    recs = json.loads(kvscope("query", "replay_traffic", "--dsn", dsn, "--param", "since=0",
                              "--param", "until=9999999999", "--format", "json"))
    assert len(recs) == N
    return {r["request_id"].split("-")[0]: r for r in recs}


def outcome(rec: dict[str, Any]) -> tuple[int, int]:
    return int(rec["preempt_count"]), rec["finished_step"] - rec["arrival_step"]


def test_the_counterfactual_is_what_the_engine_does_under_it(
        tiny_model_dir: Path, tmp_path: Path, record_property: Any) -> None:
    base = engine_run(tiny_model_dir, BLOCKS, tmp_path / "base")
    recorded = by_prompt(base["dsn"])
    total = sum(r["preempt_count"] for r in recorded.values())
    assert total > N  # the load preempts, most requests more than once
    worst = max(recorded.values(), key=lambda r: (r["preempt_count"], -r["arrival_step"]))
    rid = worst["request_id"]
    answer = json.loads(kvscope("explain", rid, "--counterfactual", "engine", "--format",
                                "json", "--dsn", base["dsn"]))
    (er,) = answer["engine_requests"]
    cf = er["counterfactual"]
    assert cf["settings"]["from"] == "engine" and cf["window"] == N
    assert cf["fidelity"]["trusted"], cf["fidelity"]
    assert cf["recorded"] == cf["server"] == {"preemptions": worst["preempt_count"],
                                              "latency_steps": outcome(worst)[1]}
    predicted = next(a for a in cf["alternatives"] if a["setting"] == ALTERNATIVE)

    alt = engine_run(tiny_model_dir, ALT_BLOCKS, tmp_path / "alternative")
    assert alt["output_tokens"] == base["output_tokens"] == [MAX_TOKENS] * N
    real = by_prompt(alt["dsn"])
    key = rid.split("-")[0]
    assert (predicted["preemptions"], predicted["latency_steps"]) == outcome(real[key])
    # every request of the window: the twin under the alternative, rebuilt from the hello
    (row,) = json.loads(kvscope("query", "engine_settings", "--dsn", base["dsn"],
                                "--format", "json"))
    cfg = replace(from_config(row).config(), num_blocks=ALT_BLOCKS)
    path = tmp_path / "window.json"
    path.write_text(json.dumps(list(recorded.values())))
    replay = load(path, seed=0, step_ms=20.0, max_model_len=1024)
    twin = measure(cfg, replay.requests, seed=0)
    twin_of = {r["request_id"]: r for r in twin.records}
    names = [r["request_id"].split("-")[0] for r in replay.records]
    predicted_all = {name: outcome(twin_of[req.request_id])
                     for name, req in zip(names, replay.requests, strict=True)}
    real_all = {name: outcome(r) for name, r in real.items()}
    record_property("preemptions", json.dumps({"base": total, "alternative": sum(
        p for p, _ in real_all.values()), "request": rid, "predicted": predicted}))
    print(f"counterfactual on the engine: {total} preemptions on {BLOCKS} blocks; {rid} "
          f"{outcome(worst)} -> predicted {predicted} on {ALT_BLOCKS}, engine "
          f"{outcome(real[key])}; window {sum(p for p, _ in real_all.values())} preemptions")
    assert predicted_all == real_all
