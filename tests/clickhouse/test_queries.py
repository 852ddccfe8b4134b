"""Every saved query runs on chDB and answers what Python computes from the same rows.

One twin run (vLLM's real scheduler, the probe, the RequestTracker) writes its rows through
the ClickHouse sink into a database of this module; each test runs one saved query and
compares it with figures computed in Python from the rows the tracker emitted.
"""

from __future__ import annotations

import argparse
import calendar
import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kvscope.rows import (
    EngineConfig,
    RequestAllocations,
    RequestEvent,
    RequestTrace,
    SchedulerDecision,
    columns,
    unrolled,
)
from kvscope.store import query, schema
from tests.clickhouse.conftest import (
    clickhouse_connect,
    count,
    database_name,
    open_sink,
)
from tests.clickhouse.twinrun import BLOCK_SIZE

pytestmark = [pytest.mark.clickhouse, pytest.mark.twin]


@dataclass
class Run:
    client: Any
    traces: list[RequestTrace]
    decisions: list[SchedulerDecision]
    rows: list[Any]
    dsn: str
    database: str


@pytest.fixture(scope="module")
def run(chdb_dsn: str, twin_runner: Any, tmp_path_factory: pytest.TempPathFactory,
        request: pytest.FixtureRequest) -> Iterator[Run]:
    db = database_name(request.node.nodeid)
    sink, manager = open_sink(chdb_dsn, db, tmp_path_factory)
    rows: list[Any] = []
    twin_runner(lambda r: (rows.append(r), manager.emit(r)))
    assert sink.flush(60)
    stats = sink.stats()
    manager.close()
    assert stats.errors == 0 and not any(stats.rows_dropped.values())
    client = clickhouse_connect.get_client(dsn=chdb_dsn, database=db)
    yield Run(client, [r for r in rows if isinstance(r, RequestTrace)],
              [r for r in rows if isinstance(r, SchedulerDecision)], rows, chdb_dsn, db)
    client.close()


def ms(ts: float) -> int:
    return round(ts * 1000)


def hour(ts: float) -> int:
    return ms(ts) // 3_600_000 * 3600


def epoch(dt: datetime) -> int:
    """clickhouse-connect returns naive UTC datetimes."""
    return calendar.timegm(dt.utctimetuple())


def saved(r: Run, name: str, **params: str) -> list[dict[str, Any]]:
    cols, rows = query.run_saved(r.client, query.SavedQuery.load(name), params)
    return [dict(zip(cols, row, strict=True)) for row in rows]


def test_every_table_holds_every_row(run: Run) -> None:
    by_table: dict[str, int] = defaultdict(int)
    for row in run.rows:
        by_table[type(row).__name__] += 1
    assert count(run.client, "request_traces") == by_table["RequestTrace"] == 80
    assert count(run.client, "request_events") == by_table["RequestEvent"]
    assert count(run.client, "request_allocations") == by_table["RequestAllocations"] > 0
    assert count(run.client, "scheduler_decisions") == by_table["SchedulerDecision"]
    assert count(run.client, "step_stats") == by_table["StepStat"]
    assert sum(t.preempt_count for t in run.traces) > 0  # the workload preempts


def test_allocations_read_back_as_the_events_they_replace(run: Run) -> None:
    """request_events_all holds every lifecycle event once and every allocation as the
    one ``allocated`` row per allocation request_events held before: each column equal,
    ts to the millisecond the store keeps."""
    allocs = [r for r in run.rows if isinstance(r, RequestAllocations)]
    events = [e for e in unrolled(run.rows) if isinstance(e, RequestEvent)]
    n_alloc = sum(len(a.step) for a in allocs)
    assert sum(e.event == "allocated" for e in events) == n_alloc > len(allocs) > 0
    # runs hold several allocations each, or nothing would be saved
    assert max(len(a.step) for a in allocs) > 1
    cols = columns("request_events")
    want = sorted(tuple(ms(e.ts) if c == "ts" else getattr(e, c) for c in cols)
                  for e in events)
    picked = ", ".join("toUnixTimestamp64Milli(ts)" if c == "ts" else c for c in cols)
    got = sorted(tuple(r) for r in run.client.query(
        f"SELECT {picked} FROM request_events_all").result_rows)
    assert len(got) == len(events)
    assert got == want


def test_hourly_preemptions(run: Run) -> None:
    want: dict[int, dict[str, Any]] = defaultdict(lambda: {
        "requests": 0, "preempted": 0, "preemptions": 0, "needed": [], "run": [], "adm": []})
    for t in run.traces:
        h = want[hour(t.ts)]
        h["requests"] += 1
        h["preempted"] += t.preempt_count > 0
        if t.max_contiguous_free_blocks_at_alloc >= 0:
            h["adm"].append(t.max_contiguous_free_blocks_at_alloc)
    preempts = [d for d in run.decisions if d.decision == "preempt"]
    for d in preempts:
        h = want[hour(d.ts)]
        h["needed"] += [d.blocks_needed] if d.blocks_needed >= 0 else []
        h["run"] += [d.max_contiguous_free] if d.max_contiguous_free >= 0 else []
        h["preemptions"] += 1
    got = saved(run, "hourly_preemptions")
    assert [epoch(g["hour"]) for g in got] == sorted(want)
    assert sum(g["preemptions"] for g in got) == len(preempts) > 0
    for g in got:
        w = want[epoch(g["hour"])]
        assert g["requests"] == w["requests"]
        assert g["preempted_requests"] == w["preempted"]
        assert g["preemption_rate"] == pytest.approx(round(w["preempted"] / w["requests"], 4))
        assert g["preemptions"] == w["preemptions"]
        assert g["avg_blocks_needed"] == pytest.approx(
            round(sum(w["needed"]) / len(w["needed"]), 2))
        assert g["min_contiguous_at_preemption"] == min(w["run"])
        assert g["min_contiguous_at_admission"] == min(w["adm"])


def test_top_preempted_requests(run: Run) -> None:
    preempted = [t for t in run.traces if t.preempt_count > 0]
    want = sorted(preempted, key=lambda t: (-t.preempt_count, -t.recomputed_tokens, ms(t.ts),
                                            t.request_id))[:5]
    got = saved(run, "top_preempted_requests", limit="5")
    assert [g["request_id"] for g in got] == [t.request_id for t in want]
    assert [g["preempt_count"] for g in got] == [t.preempt_count for t in want]
    assert [g["recomputed_tokens"] for g in got] == [t.recomputed_tokens for t in want]
    assert len(saved(run, "top_preempted_requests", limit="1000")) == len(preempted)


def test_blocks_needed_vs_free(run: Run) -> None:
    preempts = [d for d in run.decisions if d.decision == "preempt"]
    got = {g["reason"]: g for g in saved(run, "blocks_needed_vs_free")}
    assert set(got) == {d.reason for d in preempts}
    for reason, g in got.items():
        ds = [d for d in preempts if d.reason == reason]
        known = [d for d in ds if d.blocks_needed >= 0 and d.free_blocks >= 0]
        assert g["preemptions"] == len(ds)
        assert g["with_facts"] == len(known)
        assert g["free_lt_needed"] == sum(d.free_blocks < d.blocks_needed for d in known)
        assert g["free_ge_needed"] == sum(d.free_blocks >= d.blocks_needed for d in known)
        assert g["enough_free_no_run"] == sum(
            d.free_blocks >= d.blocks_needed and 0 <= d.max_contiguous_free < d.blocks_needed
            for d in known)
    # vLLM V1: every kv_full preemption is a plain shortage of free blocks
    kv = got["kv_full"]
    assert kv["free_lt_needed"] == kv["with_facts"] == kv["preemptions"] > 0


def test_tail_waste_by_prompt_len(run: Run) -> None:
    """The block size is the engine's own (its engine_configs row: the twin's 32 tokens),
    not one the caller must know and pass (the query took a parameter defaulting to 16)."""
    (config,) = [r for r in run.rows if isinstance(r, EngineConfig)]
    assert config.block_size == BLOCK_SIZE and config.kv_group_block_sizes == [BLOCK_SIZE]
    buckets: dict[int, list[RequestTrace]] = defaultdict(list)
    for t in run.traces:
        if t.allocated_blocks > 0 and t.required_blocks > 0:
            le = 1 if t.prompt_len <= 1 else 2 ** math.ceil(math.log2(t.prompt_len))
            buckets[le].append(t)
    got = saved(run, "tail_waste_by_prompt_len")
    assert [g["prompt_len_le"] for g in got] == sorted(buckets)
    for g in got:
        ts = buckets[g["prompt_len_le"]]
        tokens = sum(t.prompt_len + t.output_len for t in ts)
        waste = sum(t.required_blocks for t in ts) * BLOCK_SIZE - tokens
        assert g["requests"] == len(ts)
        assert g["tail_waste_tokens"] == waste
        assert 0 <= waste < BLOCK_SIZE * len(ts)  # at most one partial block per request
        assert g["avg_tail_waste_tokens"] == pytest.approx(round(waste / len(ts), 2))
        assert g["allocated_waste_tokens"] == sum(
            t.allocated_blocks for t in ts) * BLOCK_SIZE - tokens


def test_tail_waste_leaves_out_hybrid_engines_and_engines_without_settings(
        run: Run, store_rows: Any) -> None:
    """The run's traces stored five times: under their engine, under an engine whose
    settings say two KV cache groups (a trace's blocks then sum both groups: no block
    size measures them), under engines of one sliding-window group and one Mamba group
    (their blocks are the window's or one state, not the sequence's: a 1,000-token
    request in a 64-token window held 5 blocks) and under one with no engine_configs
    row. Only the first counts."""
    (config,) = [r for r in run.rows if isinstance(r, EngineConfig)]
    hybrid = replace(config, engine="hybrid", kv_group_kinds=["SlidingWindowSpec",
                                                               "FullAttentionSpec"],
                     kv_group_block_sizes=[BLOCK_SIZE, BLOCK_SIZE], kv_group_windows=[64, 0])
    sliding = replace(config, engine="sliding", kv_group_kinds=["SlidingWindowSpec"],
                      kv_group_windows=[64])
    mamba = replace(config, engine="mamba", kv_group_kinds=["MambaSpec"])
    others = ("hybrid", "sliding", "mamba", "unconfigured")
    rows: list[Any] = [config, hybrid, sliding, mamba, *run.traces,
                       *(replace(t, engine=e) for e in others for t in run.traces)]
    five = Run(store_rows(rows), run.traces, [], rows, run.dsn, "")
    assert saved(five, "tail_waste_by_prompt_len") == saved(run, "tail_waste_by_prompt_len")
    for engine in others:
        assert saved(five, "tail_waste_by_prompt_len", engine=engine) == [], engine


def test_preemption_cost(run: Run) -> None:
    (g,) = saved(run, "preemption_cost")
    pre = [t for t in run.traces if t.preempt_count > 0]
    recomputed = sum(t.recomputed_tokens for t in run.traces)
    tokens = sum(t.prompt_len + t.output_len for t in run.traces)
    assert (g["model"], g["engine"]) == (run.traces[0].model, run.traces[0].engine)
    assert g["requests"] == len(run.traces)
    assert g["preempted_requests"] == len(pre)
    assert g["preemptions"] == sum(t.preempt_count for t in run.traces)
    assert g["total_recomputed_tokens"] == recomputed > 0
    assert g["total_tokens"] == tokens
    assert g["recomputed_ratio"] == pytest.approx(round(recomputed / tokens, 4))
    assert g["max_recomputed_tokens"] == max(t.recomputed_tokens for t in run.traces)
    assert g["avg_recomputed_per_preempted"] == pytest.approx(
        round(sum(t.recomputed_tokens for t in pre) / len(pre), 2))


def test_filters_select_nothing_for_another_model(run: Run) -> None:
    for name in ("hourly_preemptions", "top_preempted_requests", "preemption_cost"):
        assert saved(run, name, model="no-such-model") == []


def _fill(q: query.SavedQuery) -> dict[str, str]:
    """A value for each parameter without a default (e.g. the layout heatmap's)."""
    sample = {"String": "", "DateTime64(3)": "2026-01-01 00:00:00.000",
              "DateTime64(3, 'UTC')": "2026-01-01 00:00:00.000"}
    return {k: sample.get(t, "1") for k, t in q.types.items() if k not in q.defaults}


def test_every_saved_query_runs(run: Run) -> None:
    names = [f.name[:-4] for f in schema.sql_files("queries")]
    assert {"hourly_preemptions", "top_preempted_requests", "blocks_needed_vs_free",
            "tail_waste_by_prompt_len", "preemption_cost"} <= set(names)
    for name in names:
        q = query.SavedQuery.load(name)
        assert q.about, f"{name} needs a leading comment saying what it answers"
        query.run_saved(run.client, q, _fill(q))


def cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    query.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["query", *argv])


def test_query_command_formats(run: Run, capsys: pytest.CaptureFixture[str],
                               tmp_path: Path) -> None:
    # the test's own client holds the engine; the command opens another on the same path
    base = ["--dsn", run.dsn, "--database", run.database]
    assert query.run(cli("preemption_cost", *base, "--format", "json")) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["requests"] == 80
    assert query.run(cli("top_preempted_requests", *base, "--param", "limit=3",
                         "--format", "csv")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ended,model,server,engine,request_id") and len(lines) == 4
    assert query.run(cli("blocks_needed_vs_free", *base)) == 0
    out = capsys.readouterr().out
    assert "kv_full" in out and out.rstrip().endswith("(1 rows)")
    assert query.run(cli("--list")) == 0
    assert "hourly_preemptions" in capsys.readouterr().out
    assert query.run(cli("hourly_preemptions", *base, "--param", "days=x",
                         "--param", "nope=1")) == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'nope'" in err and "days: 'x' is not a UInt32" in err
    assert query.run(cli("no_such_query", *base)) == 2
    assert query.run(cli("preemption_cost", "--dsn",
                         f"chdb://{tmp_path}/missing")) == 1


def test_engine_settings_lists_each_session_once_from_its_attach(
        run: Run, store_rows: Any) -> None:
    """A session's row is written again every hour (CONFIG_EVERY_S), so the store may hold
    several rows of one session: the query lists it once, attached at its first."""
    (config,) = [r for r in run.rows if isinstance(r, EngineConfig)]
    again = [replace(config, ts=config.ts + h * 3600.0) for h in (1, 2)]
    later = replace(config, session="s-later", ts=config.ts + 3 * 3600.0, num_blocks=99)
    got = saved(Run(store_rows([config, *again, later]), [], [], [], run.dsn, ""),
                "engine_settings")
    assert [(g["session"], g["num_blocks"]) for g in got] == [
        ("s-later", 99), (config.session, config.num_blocks)]
    assert ms(epoch(got[1]["attached"]) + got[1]["attached"].microsecond / 1e6) == ms(
        config.ts)


def test_preemption_cost_averages_only_the_times_it_knows(store_rows: Any) -> None:
    """A trace whose arrival the sidecar did not see (it took the engine up mid-run) holds
    e2e_seconds -1: averaged in, it pulled the preempted requests' mean below their real
    times (here to 1.33 from 2.5)."""
    from tests.clickhouse.rowsource import trace

    rows = [replace(trace(1), e2e_seconds=2.0), replace(trace(4), e2e_seconds=3.0),
            replace(trace(7), e2e_seconds=-1.0, queue_seconds=-1.0, max_gen_len=-1),
            replace(trace(3), e2e_seconds=1.5)]
    assert [t.preempt_count > 0 for t in rows] == [True, True, True, False]
    client = store_rows(rows)
    cols, got = query.run_saved(client, query.SavedQuery.load("preemption_cost"), {})
    (g,) = [dict(zip(cols, r, strict=True)) for r in got]
    assert (g["avg_e2e_seconds_preempted"], g["avg_e2e_seconds_not_preempted"]) == (2.5, 1.5)
    assert g["requests"] == 4 and g["preempted_requests"] == 3


def test_preemption_cost_sums_only_the_recomputation_it_knows(store_rows: Any) -> None:
    """A request preempted before the sidecar took the engine up holds recomputed_tokens
    -1 (unknown): summed in, it took one token off the total and pulled the mean down;
    the ratio's tokens are those of the requests whose recomputation is known."""
    from tests.clickhouse.rowsource import trace

    rows = [replace(trace(1), recomputed_tokens=30), replace(trace(4), recomputed_tokens=10),
            replace(trace(7), recomputed_tokens=-1), replace(trace(3), recomputed_tokens=0)]
    client = store_rows(rows)
    cols, got = query.run_saved(client, query.SavedQuery.load("preemption_cost"), {})
    (g,) = [dict(zip(cols, r, strict=True)) for r in got]
    assert (g["total_recomputed_tokens"], g["avg_recomputed_per_preempted"]) == (40, 20.0)
    known = sum(t.prompt_len + t.output_len for t in rows if t.recomputed_tokens >= 0)
    assert g["recomputed_ratio"] == round(40 / known, 4)
    assert g["total_tokens"] == sum(t.prompt_len + t.output_len for t in rows)
