"""Capacity answers checked against the real vLLM CPU server (issue 14).

The package's one server (48 blocks of 32 tokens, 32 seqs, 512-token budget) and its
sidecar with the chDB store; this module sorts last in the package because it stops the
sidecar. Two loads are recorded (each load's window of the store, and vLLM's counters
read as differences, so what the package's earlier modules sent does not count): a mixed one (the
default mix: long prompts, a shared prefix, preemptions) and a short-prompt one, whose first
wave reaches the engine together (``drive_together``) so its client's concurrency is in the
recording. The
sidecar is then stopped and the store read with ``kvscope query replay_traffic``, as a
user would.

- Fidelity: ``kvscope whatif --replay mixed.json --baseline blocks:48`` reports, before its
  columns, the server's figures, the twin's and their difference; the server's figures
  must equal vLLM's own preemption counter and sums over the records, the twin's a direct
  twin run of the replay. The error itself is reported (``record_property``), not bounded:
  the replay cannot rebuild which prompts shared a prefix.
- Safe concurrency: ``kvscope whatif --replay short.json --safe-concurrency`` answers S
  (no client timing can make it preempt: the S largest requests fit at their peaks) and
  T >= S (no preemption in the timing trials, which hold each next arrival as the short
  recording's own client did; ``kvscope.whatif.client``). The server is driven with the
  same requests (``kvscope loadgen``'s mix with ``ignore_eos``) at S, where it must not
  preempt; at T, reported; and at max_num_seqs (32), far above
  ``first_wave_preempts_from`` (where the first C requests alone overflow the pool before
  any of them ends, when they arrive together), where it must: its first wave is held by
  the paused scheduler until all of it has reached the engine (``drive_together``), as it
  once came too slowly to preempt. Between S and the first
  wave the client's timing decides: the load generator, starved of CPU on 2 cores, held
  released requests for hundreds of steps and then sent them together, and at T the
  server preempted in some runs and not in others.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.twin.config import TwinConfig
from kvscope.whatif import cli as whatif
from kvscope.whatif.concurrency import TRIALS
from kvscope.whatif.engine_settings import from_config
from kvscope.whatif.measure import measure
from kvscope.whatif.recorded import FIGURES, figures
from kvscope.whatif.replay import load
from tests.engine.figures import ENGINE, sample, saved_query

if TYPE_CHECKING:
    from tests.engine.conftest import EngineStack

pytestmark = pytest.mark.engine

MIXED = LoadSpec(n_requests=60, concurrency=32, seed=11)
SHORT = LoadSpec(n_requests=48, concurrency=4, seed=12, short_fraction=1.0,
                 max_tokens=(32, 256))


def preemptions(stack: EngineStack) -> float:
    text = httpx.get(f"{stack.vllm.url}/metrics", timeout=5.0, trust_env=False).text
    return sample(text, "vllm:num_preemptions_total", ENGINE)


def drive(stack: EngineStack, spec: LoadSpec) -> tuple[float, float, float]:
    """Run ``spec``; (first arrival bound, last arrival bound, vLLM preemptions during)."""
    before, since = preemptions(stack), time.time()
    result = run_load_sync(stack.vllm.url, spec)
    assert result.ok == spec.n_requests, result.errors
    time.sleep(1.0)  # the last step's stats reach /metrics
    return since, time.time(), preemptions(stack) - before


def drive_together(stack: EngineStack, spec: LoadSpec) -> tuple[float, float, float]:
    """``drive``, its first ``spec.concurrency`` requests held by the paused scheduler
    (vLLM's ``/pause?mode=keep``) until the API server has added every one of them to the
    engine (its "Added request" log lines; adds and the resume travel to the engine core
    on one socket, in order), then resumed: they arrive together, whatever the client's
    pace."""
    url, log = stack.vllm.url, stack.vllm.log_path

    def added() -> int:
        return log.read_text(errors="replace").count("Added request ")

    before = added()
    r = httpx.post(f"{url}/pause", params={"mode": "keep", "clear_cache": "false"},
                   timeout=30.0, trust_env=False)
    assert r.status_code == 200, r.text
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(drive(stack, spec))
        except BaseException as exc:  # noqa: BLE001 - raised again below, in the test
            out.append(exc)

    load = threading.Thread(target=run)
    try:
        load.start()
        deadline = time.monotonic() + 120.0
        while added() < before + spec.concurrency:
            assert time.monotonic() < deadline, f"{added() - before} requests added in 120 s"
            time.sleep(0.05)
        assert added() == before + spec.concurrency  # the rest wait for a free slot
    finally:
        httpx.post(f"{url}/resume", timeout=30.0, trust_env=False).raise_for_status()
        load.join(600.0)
    (result,) = out
    if isinstance(result, BaseException):
        raise result
    return result


def export(stack: EngineStack, since: float, until: float, path: Path) -> list[dict[str, Any]]:
    """``kvscope query replay_traffic`` on the stopped sidecar's store, into ``path``."""
    out = saved_query(stack, "replay_traffic", f"since={since}", f"until={until}")
    path.write_text(out)
    return json.loads(out)


@pytest.fixture(scope="module")
def recorded(engine_stack: EngineStack, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Any]:
    mixed = drive(engine_stack, MIXED)
    # its first wave held until all of it reached the engine: the recording's client then
    # had its 4 in flight at once, as whatif must read it (sent at the client's pace, on a
    # loaded machine the first request once ended before the fourth arrived: 3 read)
    short = drive_together(engine_stack, SHORT)
    engine_stack.sidecar.stop()  # releases the chDB store (rows flushed on the way out)
    tmp = tmp_path_factory.mktemp("replay")
    return {"dir": tmp, "mixed_preemptions": mixed[2],
            "mixed": export(engine_stack, mixed[0], mixed[1], tmp / "mixed.json"),
            "short": export(engine_stack, short[0], short[1], tmp / "short.json"),
            "settings": json.loads(saved_query(engine_stack, "engine_settings"))}


def whatif_run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    parser = argparse.ArgumentParser(prog="kvscope")
    whatif.add_parser(parser.add_subparsers(dest="command"))
    rc = whatif.run(parser.parse_args(["whatif", "--quiet", *argv]))
    out = capsys.readouterr().out
    assert rc == 0, out
    return out


def test_whatif_reports_its_error_against_the_server(
        recorded: dict[str, Any], capsys: pytest.CaptureFixture[str],
        record_property: pytest.RecordProperty) -> None:
    records, path = recorded["mixed"], recorded["dir"] / "mixed.json"
    assert len(records) == MIXED.n_requests
    assert sum(r["preempt_count"] for r in records) == recorded["mixed_preemptions"] > 0
    doc = json.loads(whatif_run(capsys, "--replay", str(path), "--baseline", "blocks:48",
                                "--blocks", "64", "--format", "json"))
    fid = doc["fidelity"]
    assert [s["setting"] for s in doc["settings"]] == ["server", "base"]
    assert list(fid["figures"]) == list(FIGURES)
    server = figures(records, 47)
    assert {n: f["recorded"] for n, f in fid["figures"].items()} == {
        n: server.get(n) for n in FIGURES}
    replay = load(path, seed=0, step_ms=20.0, max_model_len=1024)
    twin = measure(TwinConfig(), replay.requests, seed=0)  # blocks:48, as the server
    assert {n: f["replayed"] for n, f in fid["figures"].items()} == {
        n: figures(twin.records, 47).get(n) for n in FIGURES}
    for f in fid["figures"].values():
        assert f["error"] == f["replayed"] - f["recorded"]
    assert fid["trusted"] == all(abs(f["error"]) <= f["allowed"]
                                 for f in fid["figures"].values())
    lines = whatif_run(capsys, "--replay", str(path), "--baseline", "blocks:48",
                       "--blocks", "64").splitlines()
    gate = next(i for i, line in enumerate(lines) if line.startswith("  gate: "))
    header = lines.index(next(x for x in lines if x.split() == ["server", "base"]))
    assert lines[1].startswith("fidelity:") and gate < header  # the error comes first
    record_property("fidelity", json.dumps(fid["figures"]))
    record_property("trusted", fid["trusted"])
    print("fidelity", json.dumps(fid))


def test_a_window_over_the_packages_sidecar_restart_is_refused(
        engine_stack: EngineStack, recorded: dict[str, Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    """``test_sidecar_restart`` (before this module) stopped the package's sidecar and
    started a new one while vLLM ran on: one probe session, whose steps the new sidecar
    numbered from 1 again. The store names the two counts, whatif refuses the whole
    store's window across the sidecar's restart (exit 2), and each load recorded here is
    one count of the one session."""
    if engine_stack.sidecar.starts < 2:  # this module run alone, not with its package
        pytest.skip("the package's sidecar did not restart before this module")
    whole = export(engine_stack, 0, 99999999999, recorded["dir"] / "whole.json")
    lives = {(r["session"], r["step_counter"]) for r in whole}
    assert len(lives) == engine_stack.sidecar.starts  # a count per sidecar, one session
    assert len({session for session, _ in lives}) == 1
    parser = argparse.ArgumentParser(prog="kvscope")
    whatif.add_parser(parser.add_subparsers(dest="command"))
    rc = whatif.run(parser.parse_args(["whatif", "--quiet", "--replay",
                                       str(recorded["dir"] / "whole.json")]))
    err = capsys.readouterr().err
    assert rc == 2 and "kvscope's sidecar restarted at " in err, err
    for load_ in ("mixed", "short"):
        assert len({(r["session"], r["step_counter"]) for r in recorded[load_]}) == 1


def test_the_servers_settings_are_rebuilt_from_its_hello_alone(
        engine_stack: EngineStack, recorded: dict[str, Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    """The one probe session's ``engine_settings`` row (from the store alone) gives the
    server's own flags, and whatif under them answers as under the flags typed by hand."""
    (row,) = recorded["settings"]
    spec = engine_stack.vllm.spec
    got = from_config(row)
    assert got.spec == (f"blocks:{spec.num_gpu_blocks},block_size:{spec.block_size},"
                        f"max_seqs:{spec.max_num_seqs},budget:{spec.max_num_batched_tokens},"
                        f"policy:{spec.scheduling_policy},prefix_caching:on,layout:full,"
                        "async_scheduling:off,spec_tokens:0")
    assert got.max_model_len == spec.max_model_len
    path = str(recorded["dir"] / "mixed.json")
    by_hand, from_hello = (
        json.loads(whatif_run(capsys, "--replay", path, "--baseline", baseline,
                              "--max-model-len", str(got.max_model_len), "--format", "json"))
        for baseline in ("blocks:48", got.spec))
    assert from_hello["fidelity"] == by_hand["fidelity"]


def test_safe_concurrency_answer_and_the_first_wave_on_the_server(
        engine_stack: EngineStack, recorded: dict[str, Any],
        capsys: pytest.CaptureFixture[str], record_property: pytest.RecordProperty) -> None:
    path = recorded["dir"] / "short.json"
    assert len(recorded["short"]) == SHORT.n_requests
    doc = json.loads(whatif_run(capsys, "--replay", str(path), "--safe-concurrency",
                                "--format", "json"))
    client = doc["client"]  # the trials hold requests as this recording's client did
    assert client["concurrency"] == SHORT.concurrency
    assert len(client["gaps"]) == SHORT.n_requests - SHORT.concurrency
    (answer,) = doc["settings"]
    safe, trials_safe = answer["safe_concurrency"], answer["trials_safe_up_to"]
    first, high = answer["preempts_from"], answer["first_wave_preempts_from"]
    assert 1 <= safe <= trials_safe < first <= high <= 32, answer
    assert answer["peak_blocks_at_safe"] <= answer["usable_blocks"] == 47
    trials = answer["preempting_trials"]
    assert all(trials[str(c)] == 0 for c in range(1, trials_safe + 1))
    assert trials[str(first)] == trials[str(high)] == TRIALS
    at_safe = drive(engine_stack, replace(SHORT, concurrency=safe))[2]
    at_trials = drive(engine_stack, replace(SHORT, concurrency=trials_safe))[2]
    most = answer["max_num_seqs"]  # every request the scheduler would run at once
    above = drive_together(engine_stack, replace(SHORT, concurrency=most))[2]
    served = {"safe": [safe, at_safe], "trials_safe": [trials_safe, at_trials],
              "max_num_seqs": [most, above]}  # [concurrency, preemptions on the server]
    record_property("safe_concurrency", json.dumps(served))
    record_property("client", json.dumps(client))
    print("safe concurrency on the server", served,
          "client", {k: v for k, v in client.items() if k != "gaps"})
    assert at_safe == 0  # no timing can make the answer preempt: the server agrees
    # At max_num_seqs the first wave is far larger than the `high` requests that alone
    # overflow the pool, and it is held until all of it has arrived: the server must
    # preempt. (Sent as it came, at `high` one run did not preempt: with another agent's
    # benchmark on the machine, the starved client and API server delivered the first
    # wave so slowly that its first requests had ended before its last arrived; once in
    # CI, neither did one at max_num_seqs.)
    assert above > 0
    # Between the two the client's timing decides: at the trials' answer the server
    # preempted (once) in 1 of 9 runs; reported, not asserted.
