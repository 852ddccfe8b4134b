"""``kvscope.whatif.window``: the requests a stored window left out, read from the counts
``replay_traffic`` puts on every record, and files written before a count existed."""

from __future__ import annotations

from kvscope.whatif.window import left_out, left_out_note, lives, restart_error


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


def _rec(session: str, attached: float, counter: str = "", counted: float = 0.0) -> dict:
    return {"session": session, "session_start": attached, "step_counter": counter,
            "step_counter_start": counted}


def test_a_sidecar_restart_and_an_engine_restart_are_each_named_with_their_windows() -> None:
    """Two sidecar counts of session a (the sidecar restarted at 120 s), then session b
    (the engine restarted: attached at 200 s, its count's first row at 201 s). Each
    restart is named by what restarted; the windows between them are bounded by the
    sidecar count's first row and by the session's attach."""
    records = [_rec("a", 100.0, "c1", 100.5), _rec("b", 200.0, "c3", 201.0),
               _rec("a", 100.0, "c2", 120.0), _rec("a", 100.0, "c1", 100.5)]
    errors: list[str] = []
    found = lives(records, errors)
    assert errors == []
    assert [(life.begins, life.session, life.step_counter, life.restart) for life in found] == [
        (100_000, "a", "c1", ""), (120_000, "a", "c2", "sidecar"),
        (200_000, "b", "c3", "engine")]
    said = restart_error(found)
    assert said is not None
    assert said.startswith(
        "kvscope's sidecar restarted at 1970-01-01 00:02:00.000 UTC (epoch 120.000, probe "
        "session a, the engine running on) and the engine restarted at 1970-01-01 "
        "00:03:20.000 UTC (epoch 200.000, probe session b) inside the window: the steps "
        "stored after each count from 1 again")
    assert said.endswith("life 1, --param until=119.999; life 2, --param since=120.000 "
                         "--param until=199.999; life 3, --param since=200.000")


def test_sidecar_counts_show_a_restart_without_engine_configs_and_old_files_as_before(
        ) -> None:
    """A store with no engine_configs row names no session: its counts still show the
    sidecar's restart. A file from before step_counter names sessions only: one life
    each, an engine restart said as it was."""
    found = lives([{"step_counter": "x", "step_counter_start": 5.0},
                   {"step_counter": "y", "step_counter_start": 9.0}], [])
    said = restart_error(found)
    assert said is not None and said.startswith(
        "kvscope's sidecar restarted at 1970-01-01 00:00:09.000 UTC (epoch 9.000, the "
        "engine running on) inside the window")
    assert "before it, --param until=8.999; after it, --param since=9.000" in said
    old = lives([{"session": "a", "session_start": 1.0}, {"session": "b",
                                                           "session_start": 2.0}], [])
    assert [life.restart for life in old] == ["", "engine"]
    assert (restart_error(old) or "").startswith(
        "the engine restarted at 1970-01-01 00:00:02.000 UTC (epoch 2.000, probe session b) "
        "inside the window: its steps count from 1 again, maybe under other settings")
    assert restart_error(lives([_rec("a", 1.0, "c", 1.5)] * 3, [])) is None
    errors: list[str] = []
    assert lives([{"step_counter": "x", "step_counter_start": "soon"}], errors) == []
    assert errors == ["a record: step_counter_start must be seconds or a date-time, got "
                      "'soon'"]
