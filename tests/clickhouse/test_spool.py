"""The on-disk spool on its own: durable order and tokens, bounds, policies, one owner."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.sinks.spool import Spool, SpooledBatch, SpoolLockedError

KB = b"x" * 1024


def test_batches_survive_a_restart_in_order_with_their_tokens(tmp_path: Path) -> None:
    s = Spool(str(tmp_path), max_bytes=1 << 20)
    a = s.put("request_traces", 10, 1000.5, "tok-a", KB)
    b = s.put("step_stats", 3, 1001.0, "tok-b", KB * 2)
    s.close()
    (tmp_path / "000000000009.request_traces.1.1.tok-c.batch.tmp").write_bytes(b"cut short")
    s = Spool(str(tmp_path), max_bytes=1 << 20)
    assert s.take() == a and s.bytes == 3 * 1024 and len(s) == 2
    assert s.read(a) == KB
    s.done(a)
    assert s.take() == b and s.oldest_created() == 1001.0
    assert not list(tmp_path.glob("*.tmp"))  # a partial write was never acknowledged
    assert s.put("step_stats", 1, 1002.0, "tok-d", KB).seq == 3  # numbering continues
    s.close()


def test_one_process_owns_a_spool(tmp_path: Path) -> None:
    s = Spool(str(tmp_path))
    with pytest.raises(SpoolLockedError):
        Spool(str(tmp_path))
    s.close()
    Spool(str(tmp_path)).close()


def test_drop_oldest_spares_the_batch_in_flight(tmp_path: Path) -> None:
    s = Spool(str(tmp_path), max_bytes=3 * 1024, policy="drop_oldest")
    first = s.put("request_traces", 5, 1.0, "t1", KB)
    s.put("request_traces", 5, 2.0, "t2", KB)
    s.put("request_events", 7, 3.0, "t3", KB)
    assert s.take() == first  # being sent: never dropped under it
    s.put("request_traces", 5, 4.0, "t4", KB)
    s.put("request_traces", 5, 5.0, "t5", KB)
    assert s.dropped_rows() == {"request_traces": 5, "request_events": 7}
    assert [b.token for b in s._batches.values()] == ["t1", "t4", "t5"]
    assert s.bytes == 3 * 1024
    s.close()


def test_drop_newest_and_oversized_batches(tmp_path: Path) -> None:
    s = Spool(str(tmp_path), max_bytes=2 * 1024, policy="drop_newest")
    s.put("request_traces", 5, 1.0, "t1", KB)
    s.put("request_traces", 5, 2.0, "t2", KB)
    assert s.put("request_traces", 5, 3.0, "t3", KB) is None
    assert s.put("step_stats", 9, 4.0, "t4", KB * 3) is None  # larger than the whole spool
    assert s.dropped_rows() == {"request_traces": 5, "step_stats": 9}
    assert s.pending_rows() == {"request_traces": 10}
    s.close()


def test_names_that_are_not_batches_are_ignored(tmp_path: Path) -> None:
    assert SpooledBatch.parse("notes.txt", 3) is None
    assert SpooledBatch.parse("1.t.x.5.tok.batch", 3) is None
    b = SpooledBatch(7, "step_stats", 4, 12.345, "abc", 10)
    assert SpooledBatch.parse(b.filename, 10) == b
