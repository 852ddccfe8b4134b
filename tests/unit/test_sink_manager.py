"""SinkManager routes each row to the sinks that accept its table, asking each sink once
per table; a sink added later is asked again, and a failing sink is counted, not raised."""

from __future__ import annotations

from typing import Any

from kvscope.rows import SchedulerDecision
from kvscope.sinks.base import SinkManager


class Recording:
    def __init__(self, name: str, tables: set[str], fail: bool = False) -> None:
        self.name, self.tables, self.fail = name, tables, fail
        self.asked: list[str] = []
        self.rows: list[tuple[str, Any]] = []

    def accepts(self, table: str) -> bool:
        self.asked.append(table)
        return table in self.tables

    def write(self, table: str, row: Any) -> None:
        if self.fail:
            raise RuntimeError("broken sink")
        self.rows.append((table, row))

    def flush(self, timeout_s: float) -> None: ...

    def close(self, timeout_s: float) -> None: ...


def decision() -> SchedulerDecision:
    return SchedulerDecision(ts=1.0, model="m", engine="e", server="s", decision="preempt",
                             request_id="r", reason="", blocks_needed=-1, free_blocks=-1,
                             max_contiguous_free=-1, tokens=-1, policy="fcfs", msg="")


def test_rows_go_to_the_sinks_of_their_table_and_each_is_asked_once() -> None:
    store = Recording("store", {"scheduler_decisions", "engine_configs"})
    log = Recording("log", {"scheduler_decisions"})
    sinks = SinkManager([store, log])
    assert sinks.wants("scheduler_decisions") and not sinks.wants("request_events")
    for _ in range(3):
        sinks.emit(decision())
        assert sinks.wants("scheduler_decisions")
    assert [t for t, _ in store.rows] == ["scheduler_decisions"] * 3
    assert [t for t, _ in log.rows] == ["scheduler_decisions"] * 3
    assert store.asked == log.asked == ["scheduler_decisions", "request_events"]

    late = Recording("late", {"request_events"})
    sinks.add(late)
    assert sinks.wants("request_events")
    sinks.emit(decision())
    assert len(store.rows) == len(log.rows) == 4 and late.rows == []


def test_a_failing_sink_is_counted_and_the_others_still_take_the_row() -> None:
    broken = Recording("broken", {"scheduler_decisions"}, fail=True)
    store = Recording("store", {"scheduler_decisions"})
    sinks = SinkManager([broken, store])
    sinks.emit(decision())
    sinks.emit(decision())
    assert sinks.errors == 2 and len(store.rows) == 2
    assert not sinks.wants("engine_configs")
