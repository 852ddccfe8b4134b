"""The stored window a replay file was read from (the saved query ``replay_traffic``):
the engine lives it spans, and the requests it left out at its edges.

An engine that restarts counts its steps from 1 again, under a new probe session and
maybe other settings, while ``request_traces`` and ``request_events`` name the engine
only. ``replay_traffic`` gives each request the session it arrived in (``session``, the
latest ``engine_configs`` session attached at or before its arrival) and when that
session attached (``session_start``); a window holding two sessions would replay both
lives' requests as one step series under one config, so the replay refuses it and names
the window on either side of each restart. Records without a session (a file from before
the column, a store with no ``engine_configs`` row) cannot show a restart.

The sidecar numbers the steps itself: one that restarts while the engine runs on takes
the same session up again (from the probe's next keyframe, writing its ``engine_configs``
row as it was) and counts the steps it stores from 1 again. ``replay_traffic`` gives each
request the sidecar count it arrived in (``step_counter``, as ``request_events`` names
them, and ``step_counter_start``, the count's first row); a window over two counts of one
session is refused as one over two sessions is, the sidecar's restart named. A request
one count queued and a later one traced (its steps of two counts) is in neither's replay:
the earlier count's window counts it as not ended, the later one's as not queued.

A window is its arrivals: a request that arrived before it and still ran in it (holding
blocks the replay does not hold), and one that arrived in it but had not ended when it
was read (no trace yet), are not replayed; nor is one traced in it with no ``queued`` row
stored (the sidecar did not see it arrive: the row was lost in a gap, or it was queued
before the sidecar heard the engine; its trace dates it from its admission, and its
arrival step is unknown). ``replay_traffic`` counts the three on every record;
``left_out`` reads them and ``left_out_note`` says so, so no one takes the replay for
the whole traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from itertools import pairwise
from typing import Any, NamedTuple

from kvscope.times import epoch_seconds


class Life(NamedTuple):
    """One stretch of an engine's steps counted from 1 by one sidecar: a probe session
    (the engine's life) and the sidecar count within it."""

    begins: int
    """Epoch milliseconds from which the window's requests are this life's: the session's
    attach after an engine restart (or for the first life), the count's first row after a
    sidecar restart."""
    session: str
    step_counter: str
    restart: str
    """What began it: ``engine`` (a new probe session) or ``sidecar`` (a new sidecar
    count of the same session); "" for the window's first life."""


def _ms(rec: dict[str, Any], key: str, errors: list[str]) -> int | None:
    try:
        return round(epoch_seconds(rec.get(key)) * 1000)
    except (TypeError, ValueError):
        errors.append(f"{rec.get('_where', 'a record')}: {key} must be seconds or a "
                      f"date-time, got {rec.get(key)!r}")
        return None


def lives(records: Sequence[dict[str, Any]], errors: list[str]) -> list[Life]:
    """The lives ``records`` name (their ``session`` and ``step_counter``), earliest
    first; a ``session_start`` or ``step_counter_start`` that is not a time is reported.
    Records with neither key (a file from before them, a store with no row naming one)
    cannot show a restart."""
    found: dict[tuple[str, str], tuple[int, int]] = {}
    for rec in records:
        session, counter = (str(rec.get(k) or "") for k in ("session", "step_counter"))
        if (not session and not counter) or (session, counter) in found:
            continue
        attached = _ms(rec, "session_start", errors) if session else 0
        counted = _ms(rec, "step_counter_start", errors) if counter else 0
        if attached is not None and counted is not None:
            found[(session, counter)] = (attached, counted)
    out: list[Life] = []
    for (session, counter), (attached, counted) in sorted(
            found.items(), key=lambda kv: (max(kv[1]), kv[0])):
        if not out:
            out.append(Life(attached if session else counted, session, counter, ""))
        elif session != out[-1].session:
            out.append(Life(attached if session else counted, session, counter, "engine"))
        else:
            out.append(Life(counted, session, counter, "sidecar"))
    return out


def _stamp(ms: int, session: str, more: str = "") -> str:
    at = datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
    said = [f"epoch {ms / 1000:.3f}"] + ([f"probe session {session}"] if session else [])
    return f"{at[:-3]} UTC ({', '.join(said + ([more] if more else []))})"


def restart_error(found: list[Life]) -> str | None:
    """Why a window over ``found`` lives cannot be replayed, with the windows that can
    (``replay_traffic``'s ``since`` and ``until``, in epoch seconds); None for one."""
    if len(found) < 2:
        return None
    restarts = found[1:]
    bounds: list[int | None] = [None, *(life.begins for life in restarts), None]
    windows = []
    for since, until in pairwise(bounds):
        given = ([f"--param since={since / 1000:.3f}"] if since is not None else []) + (
            [f"--param until={(until - 1) / 1000:.3f}"] if until is not None else [])
        windows.append(" ".join(given))
    labels = (["before it", "after it"] if len(windows) == 2
              else [f"life {i}" for i in range(1, len(windows) + 1)])
    sides = "; ".join(f"{label}, {w}" for label, w in zip(labels, windows, strict=True))
    if all(life.restart == "engine" for life in restarts):
        when = " and at ".join(_stamp(life.begins, life.session) for life in restarts)
        return (f"the engine restarted at {when} inside the window: its steps count from 1 "
                "again, maybe under other settings, so one replay of its lives together "
                "would be false; read one life (kvscope query replay_traffic, your other "
                "parameters as they were): " + sides)
    what = " and ".join(
        f"the engine restarted at {_stamp(life.begins, life.session)}"
        if life.restart == "engine" else
        f"kvscope's sidecar restarted at "
        f"{_stamp(life.begins, life.session, 'the engine running on')}"
        for life in restarts)
    return (f"{what} inside the window: the steps stored after "
            f"{'it' if len(restarts) == 1 else 'each'} count from 1 again (the sidecar "
            "numbers them), so one replay of the window would be false; read one life "
            "(kvscope query replay_traffic, your other parameters as they were): " + sides)


LEFT_OUT = {"started_before": "left_out_started_before", "not_ended": "left_out_not_ended",
            "not_queued": "left_out_not_queued"}
"""``left_out``'s keys and the record keys ``replay_traffic`` counts them in."""


def left_out(records: Sequence[dict[str, Any]], errors: list[str]) -> dict[str, int] | None:
    """The window's left-out requests, by ``LEFT_OUT`` key, of the keys every record
    counts; None when the records count none (a file from before the columns, or not
    from ``replay_traffic``). A file from before ``left_out_not_queued`` has the other
    two: its ``left_out`` lacks that key, unknown, not 0."""
    if not records:
        return None
    counted = {name: key for name, key in LEFT_OUT.items()
               if all(rec.get(key) is not None for rec in records)}
    if not counted:
        return None
    out: dict[str, int] = {}
    for name, key in counted.items():
        try:  # ClickHouse's JSON quotes its 64-bit counts
            seen = {int(str(rec[key])) for rec in records}
        except ValueError:
            errors.append(f"{key} must be an integer on every record")
            continue
        if len(seen) != 1 or min(seen) < 0:
            errors.append(f"{key} must be one count >= 0 on every record, got "
                          f"{', '.join(map(str, sorted(seen)))}")
            continue
        out[name] = seen.pop()
    return out if len(out) == len(counted) else None


def left_out_note(counts: dict[str, int] | None) -> str | None:
    """A sentence on the requests the window left out; None when it left out none."""
    if not counts or not any(counts.values()):
        return None
    said = []
    if counts.get("started_before"):
        said.append(f"{counts['started_before']} arrived before the window and still ran in "
                    "it")
    if counts.get("not_ended"):
        said.append(f"{counts['not_ended']} arrived in it and had not ended when it was read "
                    "(or ended only after a sidecar restart)")
    if counts.get("not_queued"):
        said.append(f"{counts['not_queued']} have a trace in it but no queued event stored "
                    "(the sidecar did not see them arrive: the row was lost in a gap, or they "
                    "were queued before it heard the engine; so their arrival step is "
                    "unknown)")
    later = "an earlier --param since, or reading the window again once they ended, takes"
    if not counts.get("not_queued"):
        later = f" ({later} them in)"
    elif counts.get("started_before") or counts.get("not_ended"):
        later = f" ({later} in all but those with no queued event)"
    else:  # nothing in the store gives their arrival step
        later = ""
    return (f"{sum(counts.values())} requests of the engine are not in this replay: "
            f"{', '.join(said)}; it runs without them and the blocks they held, so it is "
            f"not the whole traffic{later}")
