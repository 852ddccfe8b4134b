"""Property 8: SIGTERM under load writes out or spools every row, within a bounded time.

``kvscope serve`` with the embedded store takes vLLM's real scheduler's stream (the twin at
1 ms a step) and gets SIGTERM in the middle of it. It must exit within 15 s, and the rows in
the store plus the rows left in the spool must be exactly the rows its request tracker
emitted, which the decision log (written by the same fan-out) shows independently.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvscope_probe import plugin
from tests.reliability.serveproc import ServeProcess, wait_until
from tests.reliability.stores import decision_events, read_store, spool_rows
from tests.reliability.twindrive import TwinDriver

pytestmark = [pytest.mark.reliability, pytest.mark.twin]
pytest.importorskip("kvscope.twin.engine")

EXIT_BOUND_S = 15.0


def test_sigterm_under_load_flushes_or_spools_every_row(tmp_path: Path) -> None:
    side = ServeProcess(tmp_path / "s", args=["--log-level", "info"])
    drv: TwinDriver | None = None
    try:
        side.start()
        drv = TwinDriver(side.endpoint, step_s=0.001, in_flight=48).start()
        # on disk (spooled) or in the store: the embedded store takes them every 30 s
        wait_until("rows to be spooled", lambda: (side.value(
            "kvscope_sink_rows_written_total", sink="clickhouse",
            table="request_events") or side.value(
            "kvscope_sink_spool_bytes", sink="clickhouse") or 0) > 0, 30)
        time.sleep(6.0)
        steps_at_term = drv.steps
        code, took = side.terminate(EXIT_BOUND_S)
        steps_after = drv.steps
        stderr = side.stderr()
    finally:
        if drv is not None:
            drv.stop()
        plugin.stop_all()
        side.stop()
    spooled = spool_rows(side.data_dir / "spool")
    store = read_store(str(side.data_dir / "chdb"))["tables"]
    decisions = decision_events(side.decision_log)
    both = {t: v["rows"] + spooled.get(t, 0) for t, v in store.items()}
    print(f"\nproperty 8: SIGTERM at twin step {steps_at_term} (the twin took "
          f"{steps_after - steps_at_term} more steps meanwhile): exit code {code} in "
          f"{took:.1f} s; stored { {t: v['rows'] for t, v in store.items()} } + spooled "
          f"{dict(spooled)}; decision log {dict(decisions)}")
    assert code is not None and took < EXIT_BOUND_S, stderr[-2000:]
    assert "kvscope sidecar stopped" in stderr
    assert both["scheduler_decisions"] == sum(decisions.values()) > 0
    assert both["request_traces"] == (decisions["finish"] + decisions["abort"]
                                         + decisions.get("error", 0)) > 0
    assert store["request_traces"]["distinct_request_ids"] == store["request_traces"]["rows"]
    assert all(v["duplicate_rows"] == 0 for v in store.values())
