"""The saved query ``replay_traffic`` on chDB gives exactly the records that
``kvscope.whatif.recorded.outcome_records`` makes in Python of the same rows: the server's
side and the twin's side of the fidelity gate are one measurement."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from kvscope.rows import EngineConfig, RequestEvent, RequestTrace, epoch_ms
from kvscope.store import query
from kvscope.twin import WorkloadSpec
from kvscope.whatif import cli as whatif
from kvscope.whatif.recorded import OUTCOME_KEYS, figures, has_outcomes, outcome_records
from tests.clickhouse.test_queries import Run, run, saved  # noqa: F401 (the fixture)
from tests.clickhouse.twinrun import run_twin_restarting_sidecar
from tests.twin.test_whatif import cli, parse

pytestmark = [pytest.mark.clickhouse, pytest.mark.twin]


def test_replay_traffic_equals_the_records_python_makes(run: Run) -> None:  # noqa: F811
    stored = saved(run, "replay_traffic")
    made = outcome_records(run.rows)
    assert len(stored) == len(made) == len(run.traces) == 80
    assert [{k: r[k] for k in made[0]} for r in stored] == made
    # what the query adds of the store's engine: its life (the twin's records have none)
    (config,) = [r for r in run.rows if isinstance(r, EngineConfig)]
    assert {(r["session"], r["session_start"]) for r in stored} == {
        (config.session, epoch_ms(config.ts) / 1000)}
    assert has_outcomes(stored) and set(OUTCOME_KEYS) <= set(stored[0])
    assert [r["arrival_step"] for r in stored] == sorted(r["arrival_step"] for r in stored)
    assert len({r["priority"] for r in stored}) > 1  # the mix's priorities came through
    f = figures(stored, 47)
    assert f.preemptions == sum(t.preempt_count for t in run.traces) > 0
    assert f.recomputed_tokens == sum(t.recomputed_tokens for t in run.traces)


def test_replay_traffic_window_and_engine_filters(run: Run) -> None:  # noqa: F811
    first = min(t.arrival_ts for t in run.traces)
    assert saved(run, "replay_traffic", until=str(first - 1)) == []
    assert saved(run, "replay_traffic", engine="no-such-engine") == []
    assert len(saved(run, "replay_traffic", since=str(first - 0.01))) == 80


def test_one_engine_name_on_two_servers_is_refused_not_mixed(
        run: Run, store_rows: Any) -> None:  # noqa: F811
    """Every server's first engine is named 0: the run's rows stored under two servers
    came back as one engine's replay of 160 requests, two step counts interleaved. Without
    a server the query now says to give one; with one it is that server's replay."""
    from dataclasses import replace

    rows = [replace(r, server=s) if hasattr(r, "server") else r
            for s in ("a", "b") for r in run.rows]
    two = Run(store_rows(rows), run.traces, [], rows, run.dsn, "")
    with pytest.raises(Exception, match="several engines: give --param server="):
        saved(two, "replay_traffic")
    assert saved(two, "replay_traffic", server="a") == saved(run, "replay_traffic")


def next_life(rows: list[Any], shift: float, session: str | None) -> list[Any]:
    """``rows`` again as the same engine's next life, ``shift`` seconds later: a new probe
    session (its hello, its ``engine_configs`` row), steps counted from 1 again by a new
    sidecar count, new request IDs. What the store holds after the engine restarted. With
    no ``session``, the sidecar's next count of the same session, as after the sidecar
    restarted (it writes the session's ``engine_configs`` row again as it was)."""
    from dataclasses import replace

    out = []
    for r in rows:
        changes: dict[str, Any] = {"ts": r.ts + shift}
        if isinstance(r, RequestTrace):
            changes["arrival_ts"] = r.arrival_ts + shift
        if getattr(r, "request_id", ""):
            changes["request_id"] = "after-" + r.request_id
        if hasattr(r, "step_counter"):
            changes["step_counter"] = f"{session or 'same'}-steps"
        if isinstance(r, EngineConfig):  # the sidecar's is the hello's, as it was
            changes = {"ts": r.ts + shift, "session": session} if session else {}
        out.append(replace(r, **changes))
    return out


def replay_file(path: Path, records: list[dict[str, Any]]) -> Path:
    """``records`` as ``kvscope query replay_traffic --format json`` writes them."""
    path.write_text(query.render(list(records[0]), [list(r.values()) for r in records],
                                 "json"))
    return path


def test_a_window_over_an_engine_restart_is_refused_with_the_windows_either_side(
        run: Run, store_rows: Any, tmp_path: Path,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """The engine restarted (a new probe session) a minute after the run's last row and
    served the same traffic again: both lives' steps count from 1, so a window over both
    replayed 160 requests as one engine's, under one config. whatif refuses it (exit 2,
    as bad input), naming the restart and the window on either side, and each of those
    windows is one whole life."""
    (config,) = [r for r in run.rows if isinstance(r, EngineConfig)]
    shift = max(r.ts for r in run.rows) - config.ts + 60.0
    rows = [*run.rows, *next_life(run.rows, shift, "s-after")]
    two = Run(store_rows(rows), run.traces, [], rows, run.dsn, "")
    restart = epoch_ms(config.ts + shift)  # the new session's hello, as the store keeps it
    both = saved(two, "replay_traffic")
    assert len(both) == 160
    rc, out, err = cli(capsys, "--replay", str(replay_file(tmp_path / "both.json", both)))
    assert rc == 2 and out == ""
    stamp = datetime.fromtimestamp(restart / 1000, timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S.%f")[:-3]
    assert f"restarted at {stamp} UTC (epoch {restart / 1000:.3f}, probe session s-after)" in err
    assert f"--param until={(restart - 1) / 1000:.3f}" in err
    assert f"--param since={restart / 1000:.3f}" in err
    before = saved(two, "replay_traffic", until=f"{(restart - 1) / 1000:.3f}")
    after = saved(two, "replay_traffic", since=f"{restart / 1000:.3f}")
    assert before == saved(run, "replay_traffic")
    assert {r["session"] for r in before} == {config.session}
    assert [r["request_id"] for r in after] == ["after-" + r["request_id"] for r in before]
    assert {r["session"] for r in after} == {"s-after"}
    for side in (before, after):
        work, errors = whatif.plan(parse("--replay", str(replay_file(tmp_path / "side.json",
                                                                     side))))
        assert errors == [] and work is not None and len(work.requests) == 80



def test_whatif_says_how_many_requests_ran_across_the_windows_edges(
        run: Run, store_rows: Any, tmp_path: Path,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """The store as it was read mid-run (rows up to ``read``), a window opened after the
    first arrivals: the requests that arrived before it and still ran in it, and those
    that arrived in it but had not ended when it was read, are not in the replay. The
    report counts both (JSON ``left_out``, and a note), so no one takes the replay for
    the whole traffic."""
    arrivals = sorted({epoch_ms(t.arrival_ts) for t in run.traces})
    ends = sorted({epoch_ms(t.ts) for t in run.traces})
    mid = len(arrivals) // 2
    since = (arrivals[mid - 1] + arrivals[mid]) / 2000  # between two arrival instants
    # read after some of the window's requests ended and before others did: from the
    # middle of the ends on (how the twin's steps fall into milliseconds varies with the
    # machine's speed, and the middle alone held none of the window's ended in one run)
    reads = [(a + b) / 2000 for a, b in pairwise(ends)][len(ends) // 2:]
    read = next(c for c in reads
                if any(since <= t.arrival_ts and t.ts <= c for t in run.traces)
                and any(since <= t.arrival_ts <= c < t.ts for t in run.traces))
    early = [t for t in run.traces if t.arrival_ts < since]
    assert early and all(t.ts >= since for t in early)  # each still ran when it opened
    running = [t for t in run.traces if since <= t.arrival_ts and t.ts > read]
    assert running and all(t.arrival_ts <= read for t in running)
    rows = [r for r in run.rows if r.ts <= read]
    cut = Run(store_rows(rows), run.traces, [], rows, run.dsn, "")
    window = saved(cut, "replay_traffic", since=str(since))
    assert len(window) == sum(since <= t.arrival_ts and t.ts <= read for t in run.traces) > 0
    assert {(r["left_out_started_before"], r["left_out_not_ended"]) for r in window} == {
        (len(early), len(running))}
    rc, out, _ = cli(capsys, "--replay", str(replay_file(tmp_path / "cut.json", window)),
                     "--format", "json", "--quiet")
    assert rc == 0
    doc = json.loads(out)
    assert doc["left_out"] == {"started_before": len(early), "not_ended": len(running),
                               "not_queued": 0}
    assert doc["settings"][0]["requests"] == len(window)
    assert (f"{len(early) + len(running)} requests of the engine are not in this replay: "
            f"{len(early)} arrived before the window and still ran in it, "
            f"{len(running)} arrived in it and had not ended when it was read") in "\n".join(
                doc["notes"])
    whole = saved(run, "replay_traffic")
    assert {(r["left_out_started_before"], r["left_out_not_ended"]) for r in whole} == {
        (0, 0)}


def test_whatif_says_how_many_traced_requests_it_left_out_for_want_of_a_queued_row(
        run: Run, store_rows: Any, tmp_path: Path,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """Three requests have a trace in the window, but their ``queued`` row is not in
    the store (lost in a gap, or they were queued before the sidecar started): their
    arrival step is unknown, so they are not replayed, and the report counts them (JSON
    ``left_out``, a note) as it counts the requests across the window's edges, so no one
    takes the replay for the whole traffic."""
    lost = sorted(t.request_id for t in run.traces)[10:13]
    rows = [r for r in run.rows if not (isinstance(r, RequestEvent) and r.event == "queued"
                                        and r.request_id in lost)]
    gap = Run(store_rows(rows), run.traces, [], rows, run.dsn, "")
    window = saved(gap, "replay_traffic")
    assert len(window) == 77 and not {r["request_id"] for r in window} & set(lost)
    assert {(r["left_out_started_before"], r["left_out_not_ended"],
             r["left_out_not_queued"]) for r in window} == {(0, 0, 3)}
    rc, out, _ = cli(capsys, "--replay", str(replay_file(tmp_path / "gap.json", window)),
                     "--format", "json", "--quiet")
    assert rc == 0
    doc = json.loads(out)
    assert doc["left_out"] == {"started_before": 0, "not_ended": 0, "not_queued": 3}
    assert doc["settings"][0]["requests"] == 77
    assert ("3 requests of the engine are not in this replay: 3 have a trace in it but no "
            "queued event stored") in "\n".join(doc["notes"])
    whole = saved(run, "replay_traffic")
    assert {r["left_out_not_queued"] for r in whole} == {0}


def test_a_restarted_sidecar_takes_the_session_up_again_and_names_its_new_step_count(
        store_rows: Any) -> None:
    """What the store holds after the sidecar restarted while the engine ran on: the new
    sidecar hears nothing it can place until the probe's next keyframe, which carries the
    session's hello; it admits the session from it and writes the session's
    ``engine_configs`` row again, as it was (the same session, the hello's time), so that
    table cannot show the restart. It numbers the steps it stores from 1 again (its own
    count), so the engine's steps go back: each count names itself on its rows."""
    before: list[Any] = []
    after: list[Any] = []
    run_twin_restarting_sidecar(before.append, after.append, restart_step=300,
                                outage_steps=5, spec=WorkloadSpec(
                                    n_requests=80, seed=5, waves=8, wave_interval_steps=100))
    assert ([c for c in before if isinstance(c, EngineConfig)]
            == [c for c in after if isinstance(c, EngineConfig)])
    client = store_rows(before + after)
    counts = client.query("SELECT step_counter, min(step), max(step), min(ts), max(ts) "
                          "FROM request_events_all GROUP BY step_counter ORDER BY min(ts)"
                          ).result_rows
    assert [c[0] for c in counts] == [
        next(r.step_counter for r in side if isinstance(r, RequestEvent))
        for side in (before, after)]
    (_, _, old_last, _, old_end), (_, new_first, _, new_start, _) = counts
    assert old_end < new_start and new_first < old_last  # later in time, earlier in steps


def test_a_window_over_a_sidecar_restart_is_refused_and_each_side_replays_its_own_steps(
        store_rows: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sidecar restarted while the engine ran on (one probe session): the new one
    takes the session up from the probe's next keyframe, writes the session's
    ``engine_configs`` row again as it was, and numbers the steps it stores from 1 again.
    A window over both counts replayed one engine's steps going backwards, silently; whatif
    refuses it as it refuses one over an engine restart (exit 2, the restart named, the
    window on either side), and each side replays the records of its own count alone:
    a request the old sidecar queued and the new one traced (its steps from two counts,
    its trace dated from its admission) is left out and counted."""
    before: list[Any] = []
    after: list[Any] = []
    run_twin_restarting_sidecar(before.append, after.append, restart_step=300,
                                outage_steps=5, spec=WorkloadSpec(
                                    n_requests=80, seed=5, waves=8, wave_interval_steps=100))
    (config,) = {(c.session, c.ts) for c in before + after if isinstance(c, EngineConfig)}
    queued_before = {r.request_id for r in before
                     if isinstance(r, RequestEvent) and r.event == "queued"}
    straddling = [t for t in after
                  if isinstance(t, RequestTrace) and t.request_id in queued_before]
    assert straddling and [t for t in before if isinstance(t, RequestTrace)]
    rows = before + after
    store = Run(store_rows(rows), [], [], rows, "", "")
    both = saved(store, "replay_traffic")
    rc, out, err = cli(capsys, "--replay", str(replay_file(tmp_path / "both.json", both)))
    assert rc == 2 and out == ""
    restart = min(epoch_ms(r.ts) for r in after if isinstance(r, RequestEvent))
    stamp = datetime.fromtimestamp(restart / 1000, timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S.%f")[:-3]
    assert (f"kvscope's sidecar restarted at {stamp} UTC (epoch {restart / 1000:.3f}, probe "
            f"session {config[0]}, the engine running on)") in err
    until, since = f"{(restart - 1) / 1000:.3f}", f"{restart / 1000:.3f}"
    assert f"before it, --param until={until}; after it, --param since={since}" in err
    old, new = saved(store, "replay_traffic", until=until), saved(store,
                                                                  "replay_traffic", since=since)
    for side, rows_of_side in ((old, before), (new, after)):
        made = outcome_records(rows_of_side)  # the records of one sidecar's rows alone
        assert [{k: r[k] for k in made[0]} for r in side] == made
        work, errors = whatif.plan(parse("--replay", str(replay_file(tmp_path / "side.json",
                                                                     side))))
        assert errors == [] and work is not None and len(work.requests) == len(made)
    # the requests the old sidecar queued and did not trace: the old side's replay lacks
    # them all (their end, if any, is the new count's), the new side's those it did not
    # trace either (still running when it took over, as far as the store says) and those
    # it traced from their admission, with no queued row of its own
    traced = {t.request_id for t in before + after if isinstance(t, RequestTrace)}
    untraced_old = queued_before - {t.request_id for t in before if isinstance(t, RequestTrace)}
    assert {(r["left_out_started_before"], r["left_out_not_ended"], r["left_out_not_queued"])
            for r in old} == {(0, len(untraced_old), 0)}
    assert {(r["left_out_started_before"], r["left_out_not_ended"], r["left_out_not_queued"])
            for r in new} == {(len(queued_before - traced), 0, len(straddling))}


def test_a_store_from_before_step_counters_replays_as_before_and_its_upgrade_is_a_restart(
        run: Run, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    """A store an older kvscope wrote: request_events and request_allocations without
    ``step_counter``, the view without it. The schema of this version adds the column
    (160) and the view again (170); the rows written before read '' and replay exactly as
    they did, one count. The upgrade restarted the sidecar: the rows it writes next are of
    a named count, so a window over both is refused as one over a sidecar restart."""
    from kvscope.rows import columns
    from kvscope.store import schema
    from tests.clickhouse.conftest import clickhouse_connect, database_name, open_sink
    from tests.clickhouse.test_schema import before_step_counters, columns_of

    db = database_name("replay_traffic: a store from before step_counter")
    admin = clickhouse_connect.get_client(dsn=run.dsn)
    admin.command(f"DROP DATABASE IF EXISTS {db}")
    admin.command(f"CREATE DATABASE {db}")
    for stmt in before_step_counters(schema.render_schema(db, 7)):
        admin.command(stmt)
    for table in ("request_traces", "request_events", "request_allocations", "engine_configs"):
        cols = ", ".join(c for c in columns(table) if c != "step_counter")
        admin.command(f"INSERT INTO {db}.{table} ({cols}) SELECT {cols} "
                      f"FROM {run.database}.{table}")
    assert "step_counter" not in columns_of(admin, db, "request_events")
    schema.apply_schema(admin, db, 7)
    for table in ("request_events", "request_allocations"):
        assert columns_of(admin, db, table) == columns(table)
    old = Run(clickhouse_connect.get_client(dsn=run.dsn, database=db), [], [], [], run.dsn,
              db)
    try:
        assert saved(old, "replay_traffic") == [
            r | {"step_counter": "", "step_counter_start": 0.0}
            for r in saved(run, "replay_traffic")]
        shift = max(r.ts for r in run.rows) - min(r.ts for r in run.rows) + 60.0
        upgraded = next_life(run.rows, shift, None)
        sink, manager = open_sink(run.dsn, db, tmp_path_factory)
        for r in upgraded:
            manager.emit(r)
        assert sink.flush(60)
        manager.close()
        both = saved(old, "replay_traffic")
        assert len(both) == 160
        rc, out, err = cli(capsys, "--replay", str(replay_file(tmp_path / "both.json", both)))
        restart = min(epoch_ms(r.ts) for r in upgraded if isinstance(r, RequestEvent))
        assert rc == 2 and "kvscope's sidecar restarted at " in err
        assert f"(epoch {restart / 1000:.3f}, probe session " in err
        after = saved(old, "replay_traffic", since=f"{restart / 1000:.3f}")
        assert [r["request_id"] for r in after] == [
            "after-" + r["request_id"] for r in saved(run, "replay_traffic")]
    finally:
        old.client.close()
        admin.command(f"DROP DATABASE IF EXISTS {db}")
        admin.close()
