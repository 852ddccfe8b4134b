"""The counterfactual of ``kvscope explain``: the recorded window replayed on the twin
under the server's settings, gated by whatif's fidelity check, then under alternatives.

The store is a twin run written through the ClickHouse sink, with no shared prompt
prefixes: replay records cannot say who shared one, so with them the gate fails (as it
should, and the second test shows)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from kvscope import cli
from kvscope.explain import render_json, render_text
from kvscope.explain.counterfactual import ENGINE, counterfactual
from kvscope.rows import EngineConfig, RequestTrace
from kvscope.sinks.base import SinkManager
from kvscope.state.requests import RequestTracker
from kvscope.store.sink import ClickHouseSink
from tests.clickhouse.conftest import FAST, clickhouse_connect, database_name
from tests.clickhouse.test_queries import Run, run  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.clickhouse, pytest.mark.twin]


@pytest.fixture(scope="module")
def plain(chdb_dsn: str, twin_runner: Any, tmp_path_factory: pytest.TempPathFactory,
          request: pytest.FixtureRequest) -> Iterator[tuple[Any, list[RequestTrace]]]:
    from kvscope.twin import TwinConfig, WorkloadSpec, generate
    from kvscope.twin.probed import ProbedTwin

    db = database_name(request.node.nodeid) + "_plain"
    traces = record(chdb_dsn, db, tmp_path_factory, ProbedTwin(TwinConfig(num_blocks=48), seed=6),
                    generate(WorkloadSpec(n_requests=70, seed=6, shared_prefix_fraction=0.0)))
    client = clickhouse_connect.get_client(dsn=chdb_dsn, database=db)
    yield client, traces
    client.close()


def record(chdb_dsn: str, db: str, tmp_path_factory: pytest.TempPathFactory, pt: Any,
           requests: Any) -> list[RequestTrace]:
    """Run ``requests`` on the probed twin ``pt``, its rows stored in database ``db``
    through a real sink; the traces the tracker wrote."""
    sink = ClickHouseSink(chdb_dsn, database=db, options=FAST,
                          spool_dir=str(tmp_path_factory.mktemp("spool")))
    manager = SinkManager([sink])
    rows: list[Any] = []
    pt.hub.listeners.append(RequestTracker(lambda r: (rows.append(r), manager.emit(r))).on_event)
    pt.run(requests)
    assert sink.flush(60)
    manager.close()
    return [r for r in rows if isinstance(r, RequestTrace)]


def worst(traces: list[RequestTrace]) -> RequestTrace:
    return max(traces, key=lambda t: (t.preempt_count, t.request_id))


def test_the_servers_settings_reproduce_the_request_then_the_alternatives(
        plain: tuple[Any, list[RequestTrace]]) -> None:
    client, traces = plain
    t = worst(traces)
    assert t.preempt_count > 0
    got = counterfactual(client, "0", "", t.request_id, queued_ts=t.arrival_ts, end_ts=t.ts,
                         baseline="blocks:48", window_s=3600)
    assert got["window"] == len(traces) == 70
    assert got["fidelity"]["trusted"], got["fidelity"]
    assert got["server"] == got["recorded"]
    assert got["recorded"]["preemptions"] == t.preempt_count
    names = [a["setting"] for a in got["alternatives"]]
    assert names == ["1.5x blocks", "max_seqs / 2", "priority policy", "2x block size"]
    assert all(a["preemptions"] is not None for a in got["alternatives"])


def test_the_engines_own_settings_come_from_its_stored_hello(
        plain: tuple[Any, list[RequestTrace]]) -> None:
    client, traces = plain
    t = worst(traces)
    given = counterfactual(client, "0", "", t.request_id, queued_ts=t.arrival_ts, end_ts=t.ts,
                           baseline="blocks:48", window_s=3600)
    stored = counterfactual(client, "0", "", t.request_id, queued_ts=t.arrival_ts,
                            end_ts=t.ts, baseline=ENGINE, window_s=3600)
    assert given.pop("settings") == {"from": "given", "spec": "blocks:48"}
    settings = stored.pop("settings")
    assert settings["from"] == "engine" and settings["spec"] == (
        "blocks:48,block_size:32,max_seqs:32,budget:512,policy:fcfs,prefix_caching:on,"
        "layout:full,async_scheduling:off,spec_tokens:0")
    assert stored == given  # the twin's defaults are the fixture's server: the same answer
    assert stored["fidelity"]["trusted"] and stored["alternatives"]
    lines = render_text.counterfactual({**stored, "settings": settings})
    assert (f"    server's settings (as the engine's probe reported them): {settings['spec']}"
            in lines)
    # an engine the store has no hello of: the reason, and no replay
    assert counterfactual(client, "no-such-engine", "", t.request_id, queued_ts=t.arrival_ts,
                          end_ts=t.ts, baseline=ENGINE)["errors"] == [
        "the store holds no settings of this engine (engine_configs: a sidecar before it, or "
        "that table not written): give the settings by hand"]


def test_a_failing_gate_shows_no_alternatives(run: Run,  # noqa: F811
                                              capsys: pytest.CaptureFixture[str]) -> None:
    t = worst(run.traces)
    assert cli.main(["explain", t.request_id, "--dsn", run.dsn, "--database", run.database,
                     "--counterfactual", "blocks:48", "--window", "3600",
                     "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    jsonschema.validate(body, render_json.schema())
    got = body["engine_requests"][0]["counterfactual"]
    assert not got["fidelity"]["trusted"] and got["alternatives"] == []
    assert got["fidelity"]["failing"]
    text = render_text.render(body)
    assert "the fidelity gate FAILS" in text and "no counterfactual is shown" in text


def test_the_window_is_the_requests_own_life_when_the_engine_restarted_in_it(
        run: Run, store_rows: Any) -> None:  # noqa: F811
    """The engine restarted a minute after the run and served it again: a window over
    both lives held 160 requests, two step series replayed as one. It is the request's
    own life (its probe session), exactly the answer of a store of that life alone."""
    from tests.clickhouse.test_replay_traffic import next_life

    (config,) = [r for r in run.rows if isinstance(r, EngineConfig)]
    shift = max(r.ts for r in run.rows) - config.ts + 60.0
    assert_served_again_alike(run, store_rows([*run.rows, *next_life(run.rows, shift,
                                                                     "s-after")]), shift)


def assert_served_again_alike(run: Run, client: Any, shift: float) -> None:  # noqa: F811
    """The worst request of the run served again ``shift`` seconds later in ``client``'s
    store has the counterfactual of the run's own store alone."""
    t = worst(run.traces)
    alone = counterfactual(run.client, "0", "", t.request_id, queued_ts=t.arrival_ts,
                           end_ts=t.ts, baseline="blocks:48", window_s=3600)
    after = counterfactual(client, "0", "", "after-" + t.request_id,
                           queued_ts=t.arrival_ts + shift, end_ts=t.ts + shift,
                           baseline="blocks:48", window_s=3600)
    assert alone["window"] == 80 and "errors" not in alone
    assert after == alone


def test_the_window_is_the_requests_own_sidecar_count_when_the_sidecar_restarted_in_it(
        run: Run, store_rows: Any) -> None:  # noqa: F811
    """The sidecar restarted a minute after the run (the engine ran on: one probe session)
    and the run's traffic came again: the new sidecar numbered its steps from 1 again. The
    window is the request's own count, exactly the answer of a store of that count alone,
    not both counts' steps as one series (or a refusal of the window)."""
    from tests.clickhouse.test_replay_traffic import next_life

    shift = max(r.ts for r in run.rows) - min(r.ts for r in run.rows) + 60.0
    assert_served_again_alike(run, store_rows([*run.rows, *next_life(run.rows, shift, None)]),
                              shift)


@pytest.fixture(scope="module")
def smallest(chdb_dsn: str, twin_runner: Any, tmp_path_factory: pytest.TempPathFactory,
             request: pytest.FixtureRequest) -> Iterator[tuple[str, str, list[RequestTrace]]]:
    """A server on the smallest pool vLLM starts with: 33 blocks of 32 hold exactly one
    max_model_len (1024) request."""
    from kvscope.twin import TwinConfig, WorkloadSpec, generate
    from kvscope.twin.probed import ProbedTwin

    db = database_name(request.node.nodeid) + "_smallest"
    yield chdb_dsn, db, record(
        chdb_dsn, db, tmp_path_factory, ProbedTwin(TwinConfig(num_blocks=33), seed=3),
        generate(WorkloadSpec(n_requests=30, seed=3, shared_prefix_fraction=0.0)))


def test_an_alternative_vllm_would_refuse_is_reported_not_run(
        smallest: tuple[str, str, list[RequestTrace]],
        capsys: pytest.CaptureFixture[str]) -> None:
    """"2x block size" halves the blocks: 16 blocks of 64 hold 960 tokens, fewer than
    max_model_len, and building the twin raised; explain turned that into exit 1 ("the
    store failed") and the whole explanation was lost though the gate passed. The
    alternative is reported as vLLM's refusal, the others are run."""
    from kvscope.twin import TwinConfig

    dsn, db, traces = smallest
    t = worst(traces)
    assert cli.main(["explain", t.request_id, "--dsn", dsn, "--database", db,
                     "--counterfactual", "blocks:33", "--window", "3600",
                     "--format", "json"]) == 0
    body = json.loads(capsys.readouterr().out)
    jsonschema.validate(body, render_json.schema())
    got = body["engine_requests"][0]["counterfactual"]
    assert got["fidelity"]["trusted"], got["fidelity"]
    (why,) = TwinConfig(block_size=64, num_blocks=16).validate()
    by_name = {a["setting"]: a for a in got["alternatives"]}
    assert list(by_name) == ["1.5x blocks", "max_seqs / 2", "priority policy", "2x block size"]
    assert by_name["2x block size"] == {"setting": "2x block size", "preemptions": None,
                                        "latency_steps": None, "refused": why}
    assert all(a["preemptions"] is not None and "refused" not in a
               for a in got["alternatives"][:3])
    assert f"    2x block size    vLLM would refuse: {why}" in render_text.render(body)


def test_a_window_the_twin_cannot_replay_as_asked_is_bad_usage(
        smallest: tuple[str, str, list[RequestTrace]],
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--max-model-len`` below the window's prompts: the replay refuses them
    (``ReplayError``) and explain exited 1, "the store failed", with the error's class
    name; README: 2 is bad usage. The user's fix is named."""
    dsn, db, traces = smallest
    t = worst(traces)
    assert max(x.prompt_len for x in traces) >= 64
    assert cli.main(["explain", t.request_id, "--dsn", dsn, "--database", db,
                     "--counterfactual", "blocks:33", "--window", "3600",
                     "--max-model-len", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith(f"kvscope explain: --counterfactual cannot replay the window "
                           f"around {t.request_id}: ")
    assert "leaves no room for output within max_model_len 64" in line
    assert line.endswith("; give the server's --max-model-len")
    assert "ReplayError" not in line and "Traceback" not in captured.err


@pytest.mark.parametrize(("spec", "named"), [("blocks:many", "blocks"),
                                             ("blocks:33,colour:red", "unknown key 'colour'"),
                                             ("blocks33", "is not key:value")])
def test_a_malformed_counterfactual_is_bad_usage_before_the_store_is_read(
        smallest: tuple[str, str, list[RequestTrace]], spec: str, named: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--counterfactual`` that is not a setting was reported inside the answer with
    exit 0, as if the request had been explained as asked. It is bad usage (exit 2),
    one line naming what is wrong, nothing on stdout."""
    dsn, db, traces = smallest
    assert cli.main(["explain", worst(traces).request_id, "--dsn", dsn, "--database", db,
                     "--counterfactual", spec, "--window", "3600"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("kvscope explain: --counterfactual: ")
    assert named in line
