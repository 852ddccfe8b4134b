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


def test_combined_batches_replace_their_parts_and_a_cut_combine_loses_and_repeats_nothing(
        tmp_path: Path) -> None:
    s = Spool(str(tmp_path), max_bytes=1 << 20)
    a = s.put("request_traces", 10, 1.0, "ta", KB)
    other = s.put("step_stats", 1, 1.5, "to", KB)
    b = s.put("request_traces", 20, 2.0, "tb", KB)
    head = s.take()
    assert head == a
    parts = s.after(head)
    assert parts == [a, b]  # its table's batches only, oldest first
    assert a is not None and b is not None and other is not None
    assert all(s.is_fresh(x) for x in (a, b, other))  # spooled here, never sent
    whole = s.combine(parts, KB * 2)
    assert whole.covers == (a.seq, b.seq) and whole.rows == 30 and whole.created == 1.0
    assert not s.is_fresh(whole)  # made to be sent at once
    assert s.take() == whole  # in the head's place, before the other table's batch
    assert s.pending_rows() == {"request_traces": 30, "step_stats": 1}
    assert s.bytes == 3 * 1024
    assert sorted(p.name for p in tmp_path.glob("*.batch")) == sorted(
        [whole.filename, other.filename])
    s.close()
    # A combine cut short by a crash: the combined batch renamed into place, its parts (and
    # a batch of another table numbered between them) still on disk.
    for p, payload in ((a, KB), (b, KB)):
        (tmp_path / p.filename).write_bytes(payload)
    later = SpooledBatch(whole.seq + 1, "request_traces", 5, 3.0, "tl", 1024)
    (tmp_path / later.filename).write_bytes(KB)
    s = Spool(str(tmp_path), max_bytes=1 << 20)
    assert list(s._batches.values()) == [other, whole, later]  # the parts deleted unread
    assert not any(s.is_fresh(x) for x in (other, whole, later))  # the store may hold them
    assert not (tmp_path / a.filename).exists() and not (tmp_path / b.filename).exists()
    assert s.pending_rows() == {"request_traces": 35, "step_stats": 1}
    s.close()


def test_batches_being_combined_are_never_dropped(tmp_path: Path) -> None:
    s = Spool(str(tmp_path), max_bytes=3 * 1024, policy="drop_oldest")
    a = s.put("request_traces", 5, 1.0, "t1", KB)
    s.put("request_events", 7, 2.0, "t2", KB)
    b = s.put("request_traces", 5, 3.0, "t3", KB)
    head = s.take()
    assert head is not None and s.after(head) == [a, b]
    s.put("request_traces", 5, 4.0, "t4", KB)  # room made by the other table's batch
    assert s.dropped_rows() == {"request_events": 7}
    assert s.combine([a, b], KB).rows == 10  # type: ignore[list-item]
    fresh = s.put("request_traces", 1, 5.0, "t5", KB)
    assert fresh is not None and s.is_fresh(fresh)
    s.tried(fresh)
    assert not s.is_fresh(fresh)
    s.close()
