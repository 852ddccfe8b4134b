"""``kvscope whatif``: kvscope's measurements of one workload under several settings."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import pytest
from PIL import Image

from kvscope.rows import RequestTrace
from kvscope.twin import TwinConfig, TwinRequest, WorkloadSpec, generate
from kvscope.whatif import chart
from kvscope.whatif import cli as whatif
from kvscope.whatif.replay import load
from kvscope.whatif.report import record
from kvscope.whatif.settings import build

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin

GRID = ("--block-size", "16,32", "--policy", "fcfs,priority", "--kv-tokens", "1536")
SPEC = WorkloadSpec(n_requests=60, seed=4)


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep the config-only model the twin writes out of the user's cache."""
    path = tmp_path_factory.mktemp("kvscope-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSCOPE_CACHE_DIR", str(path))
        yield path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvscope")
    whatif.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["whatif", *argv])


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = whatif.run(parse(*argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def grid() -> whatif.Report:
    plan, errors = whatif.plan(parse(*GRID, "--requests", "60", "--seed", "4"))
    assert plan is not None and errors == []
    return whatif.compare(plan, seed=4)


def test_same_seed_gives_the_same_table_and_chart(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ("--block-size", "16,32", "--kv-tokens", "1536", "--requests", "60", "--seed", "4")
    runs = [cli(capsys, *argv, "--png", str(tmp_path / f"{i}.png")) for i in range(2)]
    (rc1, table1, err1), (rc2, table2, _) = runs
    assert rc1 == rc2 == 0 and table1 == table2
    assert "wall time: block_size:16 " in err1 and "wall time" not in table1
    header = table1.splitlines()[1].split()
    assert header == ["block_size:16", "block_size:32"]
    assert (tmp_path / "0.png").read_bytes() == (tmp_path / "1.png").read_bytes()
    with Image.open(tmp_path / "0.png") as image:
        assert image.format == "PNG" and image.size == chart.size(2)
        image.load()  # decodes every pixel
        assert len(image.getcolors(1 << 16) or []) > 5


def test_preemptions_equal_vllm_scheduler_run_directly(grid: whatif.Report) -> None:
    requests = generate(SPEC)
    reasons: Counter[str] = Counter()
    for setting, m in grid.columns:
        plain = Twin(setting.config, seed=SPEC.seed).run(requests)
        assert m.preemptions_total == plain.preemptions > 0, setting.name
        assert m.steps == plain.steps and m.finished == plain.finished == len(requests)
        assert m.drained and m.faults == 0
        reasons.update(m.preemptions)
    assert reasons["unknown"] == 0 and reasons["priority"] > 0  # priority runs displace


def test_measurements_say_what_the_settings_imply(grid: whatif.Report) -> None:
    rows = {r["setting"]: r for r in (record(s, m) for s, m in grid.columns)}
    small, big = rows["block_size:16,policy:fcfs"], rows["block_size:32,policy:fcfs"]
    assert (small["num_blocks"], big["num_blocks"]) == (96, 48)  # 1536 tokens each
    assert small["preemptions_priority"] == big["preemptions_priority"] == 0
    for r in rows.values():
        assert r["peak_used_blocks"] <= r["usable_blocks"] == r["num_blocks"] - 1
        assert 0 < r["tail_waste_mean_tokens"] <= r["tail_waste_peak_tokens"]
        assert r["tail_waste_peak_tokens"] < r["block_size"] * r["max_num_seqs"]
        assert 0 < r["mean_budget_utilization_pct"] < 100
        assert r["recomputed_tokens"] <= r["preempted_tokens"]
    assert small["tail_waste_mean_tokens"] < big["tail_waste_mean_tokens"]
    assert small["blocks_per_request"] > big["blocks_per_request"]


def as_records(requests: list[TwinRequest], prefix_len: int) -> list[dict[str, object]]:
    """The replay format's records for twin requests; shared first blocks become a group."""
    heads = Counter(r.prompt_token_ids[:prefix_len] for r in requests
                    if len(r.prompt_token_ids) > prefix_len)
    out: list[dict[str, object]] = []
    for r in requests:
        rec: dict[str, object] = {"prompt_len": len(r.prompt_token_ids),
                                  "output_len": r.max_tokens, "arrival_step": r.arrival_step,
                                  "priority": r.priority}
        if heads[r.prompt_token_ids[:prefix_len]] > 1:
            rec |= {"prefix_group": "shared", "prefix_len": prefix_len}
        out.append(rec)
    return out


def test_replay_round_trip_reproduces_the_workload_and_its_figures(
        grid: whatif.Report, tmp_path: Path) -> None:
    original = generate(SPEC)
    path = tmp_path / "workload.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in as_records(original, 256)))
    replay = load(path, seed=9, step_ms=20, max_model_len=1024)
    assert [(len(r.prompt_token_ids), r.max_tokens, r.priority, r.arrival_step)
            for r in replay.requests] == [(len(r.prompt_token_ids), r.max_tokens,
                                           r.priority, r.arrival_step) for r in original]
    shared = [r.prompt_token_ids[:256] for r in replay.requests
              if len(r.prompt_token_ids) > 700]
    assert len(shared) > 1 and len(set(shared)) == 1
    # Same lengths, arrivals and prefix sharing, other token IDs: kvscope measures the same.
    (setting, expected), *_ = grid.columns
    plan = whatif.Plan([setting], replay.requests, "replay", replay.notes)
    (_, got), = whatif.compare(plan, seed=SPEC.seed).columns
    assert replace(got, wall_seconds=0) == replace(expected, wall_seconds=0)


def clickhouse_row(i: int, arrival: float, **kw: object) -> dict[str, object]:
    """A ``request_traces`` row as ``SELECT * ... FORMAT JSONEachRow`` prints it."""
    def ts(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]

    trace = RequestTrace(
        ts=arrival + 3, model="tiny", engine="0", request_id=f"cmpl-kvs-0-{i}",
        prompt_len=40 + i, max_gen_len=64, output_len=32, required_blocks=3,
        allocated_blocks=3, contiguous_allocated=True, block_fragments=1, preempt_count=0,
        preempt_reason="", recomputed_tokens=0, cached_tokens=0, free_blocks_at_alloc=10,
        max_contiguous_free_blocks_at_alloc=4, arrival_ts=arrival, queue_seconds=0.1,
        first_token_seconds=0.2, e2e_seconds=2.0, finish_reason="FINISHED_LENGTH_CAPPED")
    row = asdict(trace) | kw
    row["ts"], row["arrival_ts"] = ts(float(row["ts"])), ts(float(row["arrival_ts"]))
    return row


def test_request_traces_rows_replay(tmp_path: Path) -> None:
    t0 = 1_714_564_800.0
    rows = [clickhouse_row(0, t0 + 1.0), clickhouse_row(1, t0),
            clickhouse_row(2, t0 + 0.5, output_len=0)]  # aborted before its first token
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replay = load(path, seed=0, step_ms=25, max_model_len=1024)
    got = [(len(r.prompt_token_ids), r.max_tokens, r.arrival_step, r.priority)
           for r in replay.requests]
    assert got == [(41, 32, 0, 0), (42, 1, 20, 0), (40, 32, 40, 0)]  # 2: as far as it ran
    assert any("cannot be reconstructed" in n for n in replay.notes)


def test_bad_settings_report_every_error_at_once(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_len": 10}\nnot json\n{"prompt_len": 5000, "output_len": 1}\n')
    rc, out, err = cli(capsys, "--block-size", "16,24,x", "--kv-tokens", "600",
                       "--max-seqs", "0", "--policy", "fcfs,lifo", "--prefix-caching", "maybe",
                       "--setting", "a=block_size:32,color:red", "--replay", str(bad))
    assert rc == 2 and out == ""
    for fragment in ("--block-size: must be a positive integer, got 'x'",
                     "--max-seqs: must be a positive integer, got '0'",
                     "--policy: must be one of fcfs, priority, got 'lifo'",
                     "--prefix-caching: must be on or off",
                     "block_size has several values", "unknown key 'color'",
                     "line 1: needs output_len", "line 2: not JSON",
                     "line 3: prompt_len 5000 leaves no room"):
        assert fragment in err, fragment
    rc, _, err = cli(capsys, "--block-size", "16,24,64", "--kv-tokens", "600", "--budget", "8")
    assert rc == 2
    assert "setting block_size:24 (kv_tokens:600 -> 25 blocks of 24): block_size must be" in err
    assert err.count("fewer than max_model_len") == 3 and err.count("max_num_batched") == 3


def test_kv_memory_sizes_the_pool_like_vllm() -> None:
    errors: list[str] = []
    axes = {"block_size": ["16", "32", "64"], "kv_bytes": ["1.5MiB"]}
    settings = build(axes, [], max_model_len=1024, bytes_per_token=1024, errors=errors)
    assert errors == [] and [s.config.num_blocks for s in settings] == [96, 48, 24]
    named = build({"max_seqs": ["8"]}, ["x=kv_tokens:2048,block_size:64", "y=blocks:40"],
                  max_model_len=1024, bytes_per_token=1024, errors=errors)
    assert errors == []
    assert [(s.name, s.config.num_blocks, s.config.max_num_seqs, s.capacity) for s in named] \
        == [("x", 32, 8, "kv_tokens:2048"), ("y", 40, 8, "blocks:40")]
    assert named[1].config == TwinConfig(num_blocks=40, max_num_seqs=8)


def test_the_watermark_is_an_axis_in_vllm_s_range() -> None:
    errors: list[str] = []
    settings = build({"watermark": ["0", "0.25", "1", "-0.1", "x"]}, [], max_model_len=1024,
                     bytes_per_token=1, errors=errors)
    assert errors == [f"--watermark: must be a fraction of the pool in [0, 1), got {v!r}"
                      for v in ("1", "-0.1", "x")]
    assert [(s.name, s.config.watermark) for s in settings] == [
        ("watermark:0", 0.0), ("watermark:0.25", 0.25)]
    named = build({}, ["w=blocks:40,watermark:0.1"], max_model_len=1024, bytes_per_token=1,
                  errors=errors)
    assert named[0].config == TwinConfig(num_blocks=40, watermark=0.1)


def test_a_request_aborted_before_its_first_token_replays_only_as_far_as_it_ran(
        tmp_path: Path) -> None:
    """A traced output_len of 0 (the client left while the request was queued) was replayed
    as max_gen_len (max_tokens as the engine got it, often max_model_len - prompt): in the
    twin it ran to full context and preempted what the server never preempted. It replays
    with the one output token vLLM's least max_tokens asks for, and the notes count it."""
    from kvscope.whatif.measure import measure

    path = tmp_path / "aborted.jsonl"
    path.write_text(json.dumps({"prompt_len": 100, "output_len": 50, "arrival_step": 0}) + "\n"
                    + json.dumps({"prompt_len": 100, "output_len": 0, "max_gen_len": 924,
                                  "arrival_step": 1}) + "\n")
    replay = load(path, seed=0, step_ms=20, max_model_len=1024)
    assert [r.max_tokens for r in replay.requests] == [50, 1]
    assert ("1 request aborted before its first token (output_len 0) replayed with 1 "
            "output token (vLLM's least max_tokens), not its max_gen_len") in replay.notes
    m = measure(TwinConfig(num_blocks=33), replay.requests, seed=0)
    assert (m.finished, m.preemptions_total) == (2, 0)
