"""Property 4: a store outage loses no row and costs no memory; a full spool drops by its
policy and counts every drop; kill -9 loses no acknowledged row and duplicates none.

The outage is real: ``kvscope serve`` writes to a ClickHouse DSN on a closed port for 60 s
while vLLM's real scheduler (the twin) streams to it, then is restarted on the embedded
chDB store with the same data directory (the same spool) and must deliver every row.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvscope.rows import table_of
from kvscope.sinks.base import SinkManager
from kvscope.sinks.metrics import SinkCollector
from kvscope.sinks.options import DeliveryOptions
from kvscope.store.sink import ClickHouseSink
from kvscope_probe import plugin
from tests.reliability.serveproc import ServeProcess, wait_until
from tests.reliability.stores import decision_events, read_store, spool_rows
from tests.reliability.twindrive import TwinDriver

pytestmark = [pytest.mark.reliability, pytest.mark.twin]
pytest.importorskip("kvscope.twin.engine")

OUTAGE_S = 60.0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sink_metric(m: dict[Any, float], name: str) -> dict[str, float]:
    """{table: value} (or {"": value}) of one kvscope_sink_* family for the ClickHouse sink."""
    out = {}
    for (n, labels), v in m.items():
        lab = dict(labels)
        if n == name and lab.get("sink") == "clickhouse":
            out[lab.get("table", "")] = v
    return out


def caught_up(side: ServeProcess, drv: TwinDriver) -> bool:
    rec = drv.recorder
    got = side.value("kvscope_probe_records_received_total") or 0
    return not rec.ring and got + rec.ring_dropped + rec.send_dropped >= rec.seq


def replay(data_dir: Path, workdir: Path, expect_rows: int) -> dict[str, float]:
    """A sidecar on the embedded store with the same data directory; returns rows written
    by table once its spool is empty."""
    side = ServeProcess(workdir, data_dir=data_dir, args=["--log-level", "info"])
    try:
        side.start()
        wait_until("the spool to be replayed into chDB", lambda: (
            (m := side.metrics())
            and sink_metric(m, "kvscope_sink_spool_bytes").get("") == 0
            and sum(sink_metric(m, "kvscope_sink_rows_written_total").values()) >= expect_rows),
            120, every_s=0.5)
        written = sink_metric(side.metrics(), "kvscope_sink_rows_written_total")
        code, took = side.terminate(20)
        assert code is not None, f"the replaying sidecar did not exit ({took:.0f} s)"
    finally:
        side.stop()
    return written


def test_an_outage_under_load_loses_no_row_and_memory_stays_bounded(tmp_path: Path) -> None:
    dsn = f"http://127.0.0.1:{closed_port()}/kvscope"
    down = ServeProcess(tmp_path / "down", args=["--clickhouse-dsn", dsn, "--log-level", "info"])
    drv: TwinDriver | None = None
    rss: list[tuple[float, int]] = []
    scrapes: list[tuple[float, float, float, float]] = []
    try:
        down.start()
        drv = TwinDriver(down.endpoint, step_s=0.002).start()
        t0 = time.monotonic()
        while (now := time.monotonic()) - t0 < OUTAGE_S:
            rss.append((now - t0, down.rss_bytes()))
            if len(rss) % 10 == 5:
                m = down.metrics()
                scrapes.append((now - t0, sink_metric(m, "kvscope_sink_connected")[""],
                                sink_metric(m, "kvscope_sink_spool_bytes")[""],
                                sink_metric(m, "kvscope_sink_errors_total")[""]))
            time.sleep(1.0)
        drv.pause()
        wait_until("the sidecar to have every record", lambda: caught_up(down, drv), 30)
        steps = drv.steps
        m = down.metrics()
        assert not any(sink_metric(m, "kvscope_sink_rows_written_total").values())
        assert not any(sink_metric(m, "kvscope_sink_rows_dropped_total").values())
        code, took = down.terminate(15)
        assert code is not None, "the sidecar did not exit within 15 s of SIGTERM"
        stderr = down.stderr()
    finally:
        if drv is not None:
            drv.stop()
        plugin.stop_all()
        down.stop()
    spooled = spool_rows(down.data_dir / "spool")
    written = replay(down.data_dir, tmp_path / "up", sum(spooled.values()))
    store = read_store(str(down.data_dir / "chdb"))["tables"]
    decisions = decision_events(down.decision_log)
    base = next(r for t, r in rss if t >= 10)
    late = max(r for t, r in rss if t >= OUTAGE_S - 30)
    print(f"\nproperty 4a: {OUTAGE_S:.0f} s outage (closed port) under {steps} twin steps: "
          f"scrapes (t, connected, spool bytes, errors) {scrapes}; RSS at 10 s "
          f"{base / 2**20:.0f} MiB, peak of the last 30 s {late / 2**20:.0f} MiB, max "
          f"{max(r for _, r in rss) / 2**20:.0f} MiB; SIGTERM exit in {took:.1f} s; spooled "
          f"{dict(spooled)}; replayed into chDB {written}; stored "
          f"{ {t: v['rows'] for t, v in store.items()} }; rows lost "
          f"{sum(spooled.values()) - sum(v['rows'] for v in store.values())}")
    assert "delivery failed" in stderr and "Connection refused" in stderr
    assert all(c == 0 for _, c, _, _ in scrapes) and scrapes[-1][3] >= 3
    assert [b for _, _, b, _ in scrapes] == sorted(b for _, _, b, _ in scrapes)  # grows on disk
    assert late - base < 64 << 20, "the sidecar's memory grew with the outage"
    # every row the sidecar took is in the store once, none lost, none doubled
    assert sum(spooled.values()) > 10_000
    for table, n in spooled.items():
        assert store[table]["rows"] == n == written[table], table
    assert store["request_traces"]["distinct_request_ids"] == store["request_traces"]["rows"]
    assert store["request_traces"]["duplicate_rows"] == store["scheduler_decisions"][
        "duplicate_rows"] == 0
    # and they are the rows the tracker emitted: the decision log saw the same decisions
    assert store["scheduler_decisions"]["rows"] == sum(decisions.values())
    assert store["request_traces"]["rows"] == (decisions["finish"] + decisions["abort"]
                                              + decisions.get("error", 0)) > 100


@pytest.mark.parametrize("policy", ["drop_oldest", "drop_newest"])
def test_a_full_spool_drops_by_its_policy_and_counts_every_drop(tmp_path: Path,
                                                                policy: str) -> None:
    from tests.clickhouse.twinrun import run_twin

    opts = DeliveryOptions(batch_rows=200, batch_interval_s=0.05, spool_max_bytes=96 << 10,
                           spool_policy=policy, fsync=False, backoff_initial_s=0.05,
                           backoff_max_s=0.1)
    sink = ClickHouseSink(f"http://127.0.0.1:{closed_port()}/kvscope", options=opts,
                          spool_dir=str(tmp_path / "spool"))
    manager = SinkManager([sink])
    emitted: Counter[str] = Counter()

    def emit(row: Any) -> None:
        emitted[table_of(row)] += 1
        manager.emit(row)

    try:
        run_twin(emit, n_requests=200, seed=3)
        assert not sink.flush(2.0)  # every row spooled or dropped, none delivered
        reg = CollectorRegistry()
        reg.register(SinkCollector(manager))
        pending = sink.spool.pending_rows()
        seqs = sorted(b.seq for b in sink.spool._batches.values())
        issued = sink.spool._next_seq - 1
        spool_bytes = sink.stats().spool_bytes
    finally:
        sink.close(0.5)
    dropped = {t: reg.get_sample_value("kvscope_sink_rows_dropped_total",
                                       {"sink": "clickhouse", "table": t}) for t in emitted}
    print(f"\nproperty 4b ({policy}): emitted {dict(emitted)}; spool {spool_bytes} bytes "
          f"(bound {opts.spool_max_bytes}) holds {dict(pending)} in {len(seqs)} of "
          f"{issued} batches; kvscope_sink_rows_dropped_total {dropped}")
    for table, n in emitted.items():
        assert pending.get(table, 0) + dropped[table] == n, table
    assert sum(dropped.values()) > 0 and spool_bytes <= opts.spool_max_bytes
    # drop_oldest keeps the newest batches, drop_newest the oldest ones. Either way the
    # batch a delivery attempt holds at that moment is never deleted under it
    # (Spool._make_room skips it): with drop_oldest that one batch, older than the rest,
    # may survive beside the newest run.
    if policy == "drop_oldest":
        newest = list(range(issued - len(seqs) + 1, issued + 1))
        held = list(range(issued - len(seqs) + 2, issued + 1))
        assert seqs == newest or (seqs[1:] == held and seqs[0] < held[0]), seqs
    else:
        assert seqs == list(range(1, len(seqs) + 1))


def test_kill_9_during_a_flush_loses_no_acknowledged_row_and_duplicates_none(
        tmp_path: Path) -> None:
    rng = random.Random(9)
    side = ServeProcess(tmp_path / "killed", args=["--log-level", "info"])
    drv: TwinDriver | None = None
    try:
        side.start()
        drv = TwinDriver(side.endpoint, step_s=0.002).start()
        time.sleep(rng.uniform(5.0, 8.0))
        # kill the moment a batch is on disk and not yet acknowledged: a flush in progress
        spool = side.data_dir / "spool"
        acked: dict[str, float] = {}
        deadline = time.monotonic() + 30
        while not acked and time.monotonic() < deadline:
            before = sink_metric(side.metrics(), "kvscope_sink_rows_written_total")
            until = time.monotonic() + 1.5
            while time.monotonic() < until:
                if any(n.endswith(".batch") for n in os.listdir(spool)):
                    side.kill()
                    acked = before
                    break
                time.sleep(0.0005)
        assert acked, "no flush caught in 30 s"
        spooled = spool_rows(side.data_dir / "spool")
    finally:
        if drv is not None:
            drv.stop()
        plugin.stop_all()
        side.stop()
    written = replay(side.data_dir, tmp_path / "recovered", sum(spooled.values()))
    store = read_store(str(side.data_dir / "chdb"))["tables"]
    print(f"\nproperty 4c: kill -9 with {dict(spooled)} rows spooled and {acked} acknowledged; "
          f"replayed {written}; stored { {t: v['rows'] for t, v in store.items()} }, "
          f"duplicate rows { {t: v['duplicate_rows'] for t, v in store.items()} }")
    assert sum(spooled.values()) > 0
    for table, n in acked.items():
        assert store[table]["rows"] >= n, table  # no acknowledged row lost
    traces = store["request_traces"]
    assert traces["rows"] == traces["distinct_request_ids"] and traces["duplicate_rows"] == 0
    assert store["scheduler_decisions"]["duplicate_rows"] == 0

