"""The decision log writes on its own thread: a stalled stdout never blocks the caller
(the ingest thread, under the hub lock); a full queue and failed writes are counted and
exported as kvscope_sink_* metrics; the file still rotates."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvscope.decisions.log import TABLE, DecisionLog
from kvscope.rows import SchedulerDecision
from kvscope.sinks.metrics import SinkCollector


def decision(i: int) -> SchedulerDecision:
    return SchedulerDecision(ts=1.0 + i, model="tiny", engine="0", decision="preempt",
                             request_id=f"r{i}", reason="kv_full", blocks_needed=2,
                             free_blocks=0, max_contiguous_free=0, tokens=64, policy="fcfs",
                             msg=f"Preempting request r{i} due to kv_full", server="s:1")


class StalledStream(io.StringIO):
    """A stdout whose reader stopped: write() waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.release.wait(30)
        return super().write(text)


class BrokenStream(io.StringIO):
    """A closed pipe: every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def sample(log: DecisionLog, name: str, **labels: str) -> float | None:
    reg = CollectorRegistry()
    reg.register(SinkCollector([log]))
    return reg.get_sample_value(name, {"sink": "decision_log", **labels})


def test_a_stalled_stream_never_blocks_the_caller_and_overflow_is_counted() -> None:
    out = StalledStream()
    log = DecisionLog(stream=out, max_queue=10)
    log.write(TABLE, decision(0))
    assert out.entered.wait(10)  # the writer thread is stuck in the stream's write
    for i in range(1, 26):  # returns at once although the stream is stuck
        log.write(TABLE, decision(i))
    assert log.stats().queued_rows == 10 and log.dropped == 15
    out.release.set()
    log.close(10)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [ln["request_id"] for ln in lines] == [f"r{i}" for i in range(11)]
    assert lines[0]["server"] == "s:1" and lines[0]["engine"] == "0"
    assert sample(log, "kvscope_sink_rows_written_total", table=TABLE) == 11
    assert sample(log, "kvscope_sink_rows_dropped_total", table=TABLE) == 15
    assert sample(log, "kvscope_sink_errors_total") == 0


def test_write_errors_are_counted_and_their_lines_dropped() -> None:
    log = DecisionLog(stream=BrokenStream())
    for i in range(3):
        log.write(TABLE, decision(i))
    log.flush(10)
    st = log.stats()
    assert st.errors >= 1 and st.rows_dropped[TABLE] == 3 and st.rows_written[TABLE] == 0
    assert not st.connected and st.last_error == "BrokenPipeError"
    assert sample(log, "kvscope_sink_connected") == 0
    log.close(5)


def test_the_file_rotates_from_the_writer_thread(tmp_path: Path) -> None:
    path = tmp_path / "decisions.jsonl"
    log = DecisionLog(str(path), max_bytes=8192)
    for batch in range(4):  # each batch of 50 lines outgrows 8 KiB: a rotation after each
        for i in range(50):
            log.write(TABLE, decision(50 * batch + i))
        log.flush(10)
    log.close(10)
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["decisions.jsonl", "decisions.jsonl.1",
                                       "decisions.jsonl.2", "decisions.jsonl.3",
                                       "decisions.jsonl.4"]
    assert log.lines == 200 and log.dropped == 0
    assert sum(len(f.read_text().splitlines()) for f in files) == 200


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_lines_arriving_one_by_one_are_written_in_batches() -> None:
    """A busy engine makes ~100 decisions a second; the writer wakes and writes once per
    LINGER_S, not once per line (before: one wakeup and one write each, 50 here)."""
    import time

    from kvscope.decisions.log import LINGER_S

    out = CountingStream()
    log = DecisionLog(stream=out)
    t0 = time.monotonic()
    for i in range(50):  # 50 lines over ~0.1 s, well inside one linger
        log.write(TABLE, decision(i))
        time.sleep(0.002)
    spread = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while log.lines < 50 and time.monotonic() < deadline:  # written without a flush
        time.sleep(0.01)
    assert log.lines == 50
    assert out.writes <= 1 + int(spread / LINGER_S) + 1
    assert [json.loads(x)["request_id"] for x in out.getvalue().splitlines()] == [
        f"r{i}" for i in range(50)]
    log.close(5)
