"""``kvscope.whatif.window``: the requests a stored window left out, read from the counts
``replay_traffic`` puts on every record, and files written before a count existed."""

from __future__ import annotations

from kvscope.whatif.window import left_out, left_out_note


def test_a_file_from_before_the_not_queued_count_keeps_the_counts_it_has() -> None:
    """A replay file read before ``left_out_not_queued`` existed counts the other two: they
    are still said, and the third is absent (unknown), not a 0 the file never stated."""
    records = [{"left_out_started_before": "2", "left_out_not_ended": 1}] * 3
    errors: list[str] = []
    assert left_out(records, errors) == {"started_before": 2, "not_ended": 1}
    assert errors == []
    note = left_out_note({"started_before": 2, "not_ended": 1})
    assert note is not None and note.startswith("3 requests of the engine are not in this")
    assert "queued" not in note


def test_not_queued_is_counted_said_and_checked_like_the_others() -> None:
    records = [{"left_out_started_before": 0, "left_out_not_ended": 0,
                "left_out_not_queued": "4"}] * 2
    errors: list[str] = []
    counts = left_out(records, errors)
    assert counts == {"started_before": 0, "not_ended": 0, "not_queued": 4} and errors == []
    note = left_out_note(counts)
    assert note is not None and note.startswith(
        "4 requests of the engine are not in this replay: 4 have a trace in it but no queued "
        "event stored")
    assert "--param since" not in note  # no window takes them in
    mixed = [{"left_out_started_before": 0, "left_out_not_ended": 0,
              "left_out_not_queued": n} for n in (1, 2)]
    assert left_out(mixed, errors) is None
    assert errors == ["left_out_not_queued must be one count >= 0 on every record, got 1, 2"]
    assert left_out([{"left_out_not_queued": 1}, {}], []) is None  # not on every record
