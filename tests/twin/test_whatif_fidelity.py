"""The fidelity gate and safe concurrency of ``kvscope whatif``, on vLLM's real scheduler.

A twin run stands in for a recorded server here (the engine test does it against a real
one): its RequestTracker rows become replay records, and replaying those under the same
settings must give the same five figures exactly (error 0, the gate passes); under other
settings the gate must fail and say on which figures.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.whatif.client import Client, recorded_client, recorded_gaps
from kvscope.whatif.concurrency import (
    MAX_DELAY_STEPS,
    TRIALS,
    closed_loop,
    peak_blocks,
    safe_concurrency,
)
from kvscope.whatif.measure import measure
from kvscope.whatif.recorded import FIGURES, figures
from tests.twin.test_whatif import cli

pytestmark = pytest.mark.twin

# No shared prefix: replay records cannot say who shared one (see kvscope.whatif.replay).
SPEC = WorkloadSpec(n_requests=70, seed=6, shared_prefix_fraction=0.0)
SHORT = WorkloadSpec(n_requests=40, seed=2, short_fraction=1.0, max_tokens=(32, 256), waves=1)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, object]]]:
    requests = generate(SPEC)
    m = measure(TwinConfig(), requests, seed=SPEC.seed)
    assert m.preemptions_total > 0 and m.drained and m.faults == 0
    # The records say what the run did, as the hub counted it.
    f = figures(m.records, m.usable_blocks)
    assert (f.preemptions, f.recomputed_tokens, f.peak_used_blocks) == (
        m.preemptions_total, m.recomputed_tokens, m.peak_used_blocks)
    assert [r["arrival_step"] for r in m.records] == sorted(r.arrival_step for r in requests)
    assert {r["arrival_step"] for r in m.records} == {0, 20, 40, 60}  # the four waves
    path = tmp_path_factory.mktemp("fidelity") / "recorded.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in m.records))
    return path, m.records


def test_replay_under_the_same_settings_has_no_error(
        recorded: tuple[Path, list[dict[str, object]]],
        capsys: pytest.CaptureFixture[str]) -> None:
    path, records = recorded
    rc, out, _ = cli(capsys, "--replay", str(path), "--baseline", "blocks:48",
                     "--blocks", "40", "--seed", "3", "--format", "json")
    assert rc == 0
    doc = json.loads(out)
    fid = doc["fidelity"]
    expected = figures(records, 47)
    assert fid["trusted"] is True and fid["failing"] == []
    for name in FIGURES:
        f = fid["figures"][name]
        assert f["recorded"] == f["replayed"] == expected.get(name), name
        assert f["error"] == 0 and f["allowed"] == max(1, int(0.1 * f["recorded"]))
    assert [s["setting"] for s in doc["settings"]] == ["server", "base"]
    assert doc["settings"][0]["preemptions"] == expected.preemptions


def test_replay_under_other_settings_fails_the_gate(
        recorded: tuple[Path, list[dict[str, object]]],
        capsys: pytest.CaptureFixture[str]) -> None:
    path, records = recorded
    rc, out, _ = cli(capsys, "--replay", str(path), "--baseline", "blocks:96",
                     "--format", "json")
    assert rc == 0
    fid = json.loads(out)["fidelity"]
    twin = measure(TwinConfig(num_blocks=96), json_requests(path), seed=0)
    assert {n: f["replayed"] for n, f in fid["figures"].items()} == {
        n: figures(twin.records, 95).get(n) for n in FIGURES}
    assert {n: f["recorded"] for n, f in fid["figures"].items()} == {
        n: figures(records, 95).get(n) for n in FIGURES}
    assert fid["trusted"] is False and "preemptions" in fid["failing"]
    rc, out, _ = cli(capsys, "--replay", str(path), "--baseline", "blocks:96")
    lines = out.splitlines()
    assert lines[1].startswith("fidelity: ")
    row = next(x for x in lines if x.startswith("  preemptions "))
    p = fid["figures"]["preemptions"]
    assert row.split()[1:5] == [str(p["recorded"]), str(p["replayed"]),
                                f"{p['error']:+d}", f"±{p['allowed']}"]
    gate = next(x for x in lines if x.startswith("  gate: "))
    assert "FAILED on preemptions" in gate
    header = next(i for i, x in enumerate(lines) if x.split() == ["server", "base"])
    assert lines.index(gate) < header


def json_requests(path: Path) -> list[object]:
    from kvscope.whatif.replay import load

    return load(path, seed=0, step_ms=20.0, max_model_len=1024).requests


def test_baseline_needs_recorded_outcomes(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"prompt_len": 20, "output_len": 5}\n')
    rc, _, err = cli(capsys, "--replay", str(path), "--baseline", "blocks:48")
    assert rc == 2 and "--baseline needs --replay of a file that records" in err
    rc, _, err = cli(capsys, "--baseline", "blocks:48")
    assert rc == 2 and "--baseline needs --replay" in err
    rc, _, err = cli(capsys, "--safe-concurrency", "--png", str(tmp_path / "x.png"))
    assert rc == 2 and "--safe-concurrency has no chart" in err


@pytest.mark.parametrize("cfg", [TwinConfig(), TwinConfig(layout="full+sliding",
                                                          sliding_window=64, num_blocks=96)],
                         ids=["full", "full+sliding"])


@pytest.mark.once
def test_safe_concurrency_is_what_the_closed_loop_runs_show(cfg: TwinConfig) -> None:
    requests = generate(SHORT)
    a = safe_concurrency(cfg, requests, seed=2)
    assert 1 <= a.trials_safe < a.preempts_from <= cfg.max_num_seqs and not a.capped
    for c in range(1, a.trials_safe + 1):
        assert [t.preemptions for t in a.at(c)] == [0] * TRIALS
        assert max(t.peak_running for t in a.at(c)) == c  # the loop keeps c in flight
    assert all(t.preemptions > 0 for t in a.at(a.preempts_from))
    assert a.preempts_from <= a.first_wave_from == max(t.concurrency for t in a.trials)
    assert all(t.first_wave for t in a.at(a.first_wave_from))
    assert not all(t.first_wave for t in a.at(a.first_wave_from - 1))
    assert max(a.at(a.trials_safe + 1), key=lambda t: t.preemptions).preemptions > 0
    again = closed_loop(cfg, requests, a.trials_safe, seed=2, delay_seed=TRIALS - 1)
    assert again == a.at(a.trials_safe)[-1]  # seeded: the same trial every time
    # The answer no timing breaks: the `safe` largest requests fit at their peaks, one
    # more does not; the trials, a subset of all timings, agree.
    usable = cfg.num_blocks - 1
    assert sum(a.peaks[:a.safe]) <= usable < sum(a.peaks[:a.safe + 1])
    assert 1 <= a.safe <= a.trials_safe
    assert a.peaks == tuple(sorted(peak_blocks(cfg, requests), reverse=True))
    if cfg.layout == "full":  # a request's last token takes its last block: vLLM's count
        assert sorted(peak_blocks(cfg, requests)) == sorted(
            -(-(len(r.prompt_token_ids) + r.max_tokens - 1) // cfg.block_size)
            for r in requests)


@pytest.mark.once
def test_safe_concurrency_stops_at_max_num_seqs(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--safe-concurrency", "--short-fraction", "1", "--max-tokens",
                     "8:16", "--requests", "12", "--waves", "1", "--max-seqs", "3",
                     "--blocks", "48", "--format", "json")
    assert rc == 0
    (r,) = json.loads(out)["settings"]
    assert (r["safe_concurrency"], r["trials_safe_up_to"], r["preempts_from"],
            r["capped_by_max_num_seqs"]) == (3, 3, None, True)
    assert r["preempting_trials"] == {"1": 0, "2": 0, "3": 0}


def closed_loop_recording(gap: int, concurrency: int = 3) -> list[dict[str, object]]:
    """A closed loop at ``concurrency`` whose every next request comes ``gap`` steps after
    an end, replayed with its arrivals and recorded as the sidecar records a server."""
    requests = generate(SHORT)
    trial = closed_loop(TwinConfig(), requests, concurrency, seed=2, delay_seed=1,
                        latency=(gap,))  # an odd seed: no swaps, the arrivals in order
    assert trial.preemptions == 0 and len(trial.arrivals) == len(requests)
    timed = [replace(r, arrival_step=a) for r, a in zip(requests, trial.arrivals, strict=True)]
    m = measure(TwinConfig(), timed, seed=2)
    assert m.drained and m.faults == 0 and m.preemptions_total == 0
    return m.records


def steps(records: list[dict[str, object]], key: str) -> list[int]:
    return sorted(int(r[key]) for r in records)  # type: ignore[call-overload]


@pytest.mark.parametrize("gap", [0, 5])
def test_recorded_gaps_are_the_delays_the_closed_loop_had(gap: int) -> None:
    records = closed_loop_recording(gap)
    # The step convention: a request sent the moment another ended has gap 0.
    assert recorded_gaps(records) == (gap,) * (len(records) - 3)
    assert recorded_gaps([{k: v for k, v in r.items() if k != "finished_step"}
                          for r in records]) is None  # a file from before the column
    client = recorded_client(records)
    assert client is not None and client.gaps == recorded_gaps(records)
    assert client.concurrency == 3
    # The request the sixth end released arrives at the third end instead: four in
    # flight at once, so the client's concurrency was 4.
    ends = steps(records, "finished_step")
    assert ends[2] < ends[3]
    early = sorted((dict(r) for r in records), key=lambda r: r["arrival_step"])
    early[3 + 5]["arrival_step"] = ends[2]
    other = recorded_client(early)
    assert other is not None and other.concurrency == 4
    # Held: from each releasing end until its request was sent.
    released = ends[:len(records) - 3]
    assert client.held == {e - ends[0] + i for e in released for i in range(gap)}
    assert client.span == steps(records, "arrival_step")[-1] - ends[0] + 1
    assert (client.longest_hold >= gap) and (client.longest_hold > 0) == (gap > 0)


def test_a_recorded_client_sends_at_its_first_free_step() -> None:
    pattern = Client(frozenset({2, 3, 4}), 10, 1, ())
    assert [pattern.send_step(t, 0) for t in (0, 1, 2, 4, 5)] == [0, 1, 5, 5, 5]
    assert pattern.send_step(0, 2) == 3  # positions 2-4 held, replayed from 2
    assert pattern.send_step(9, 3) == 12  # wraps: positions 2, 3, 4 held, then 5
    assert pattern.longest_hold == 3


@pytest.mark.once
def test_safe_concurrency_replays_the_recorded_client(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    records = closed_loop_recording(5)
    path = tmp_path / "closed.json"
    path.write_text(json.dumps(records))
    rc, out, _ = cli(capsys, "--replay", str(path), "--safe-concurrency", "--format", "json")
    assert rc == 0
    client = recorded_client(records)
    assert client is not None
    assert json.loads(out)["client"] == {
        "concurrency": 3, "span_steps": client.span, "held_steps": len(client.held),
        "longest_hold_steps": client.longest_hold, "gaps": [5] * (len(records) - 3)}
    rc, out, _ = cli(capsys, "--replay", str(path), "--safe-concurrency")
    assert rc == 0 and (f"held while the recording's client held its requests: "
                        f"{len(client.held)} of {client.span} steps") in out
    path.write_text(json.dumps([{k: v for k, v in r.items() if k != "finished_step"}
                                for r in records]))
    rc, out, _ = cli(capsys, "--replay", str(path), "--safe-concurrency", "--format", "json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["client"] is None and doc["max_delay_steps"] == MAX_DELAY_STEPS


def quoted(record: dict[str, object]) -> dict[str, object]:
    """A record as ClickHouse's ``FORMAT JSONEachRow`` prints it: Int64 and UInt64
    quoted (``output_format_json_quote_64bit_integers``, on by default)."""
    return {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in record.items()}


def test_a_clickhouse_export_with_quoted_integers_is_checked_as_written(
        recorded: tuple[Path, list[dict[str, object]]],
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """ClickHouse quotes 64-bit integers: ``load`` converted arrival_step and kept
    admitted_step a string, so ``figures`` compared ``"9" > 4`` and ``--baseline`` died
    with a TypeError after the baseline run. Every step and outcome key is an int once
    loaded, and the gate reads the quoted file exactly as the unquoted one."""
    from kvscope.whatif.replay import ReplayError, load

    _, records = recorded
    path = tmp_path / "quoted.jsonl"
    path.write_text("".join(json.dumps(quoted(r)) + "\n" for r in records))
    kept = load(path, seed=0, step_ms=20.0, max_model_len=1024).records
    assert figures(kept, 47) == figures(records, 47)
    keys = ("arrival_step", "admitted_step", "finished_step", "preempt_count",
            "recomputed_tokens", "min_free_blocks")
    assert [[r[k] for k in keys] for r in kept] == [[r[k] for k in keys] for r in records]
    rc, out, _ = cli(capsys, "--replay", str(path), "--baseline", "blocks:48",
                     "--blocks", "40", "--seed", "3", "--format", "json")
    assert rc == 0
    fid = json.loads(out)["fidelity"]
    assert fid["trusted"] is True
    assert {n: f["recorded"] for n, f in fid["figures"].items()} == {
        n: figures(records, 47).get(n) for n in FIGURES}

    bad = dict(quoted(records[0]), admitted_step="nine", preempt_count="1.5")
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ReplayError) as info:
        load(path, seed=0, step_ms=20.0, max_model_len=1024)
    assert info.value.errors == ["line 1: admitted_step must be an integer, got 'nine'",
                                 "line 1: preempt_count must be an integer, got '1.5'"]
