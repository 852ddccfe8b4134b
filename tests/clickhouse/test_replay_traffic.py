"""The saved query ``replay_traffic`` on chDB gives exactly the records that
``kvscope.whatif.recorded.outcome_records`` makes in Python of the same rows: the server's
side and the twin's side of the fidelity gate are one measurement."""

from __future__ import annotations

from typing import Any

import pytest

from kvscope.whatif.recorded import OUTCOME_KEYS, figures, has_outcomes, outcome_records
from tests.clickhouse.test_queries import Run, run, saved  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.clickhouse, pytest.mark.twin]


def test_replay_traffic_equals_the_records_python_makes(run: Run) -> None:  # noqa: F811
    stored = saved(run, "replay_traffic")
    made = outcome_records(run.rows)
    assert len(stored) == len(made) == len(run.traces) == 80
    assert stored == made
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
