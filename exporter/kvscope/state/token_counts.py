"""The running requests' token counts, kept without a store per request per step.

Every step sends the computed and the scheduled tokens of every request it schedules
again (``Step.cached_ids``, in vLLM's order). Stored into two dictionaries, that was
512 dictionary stores a step at 256 running, about a quarter of the sidecar's ingest
(benchmarks/README.md). Here the latest step's lists are kept as they were decoded, with
each request's position in them, and read through; the dictionaries hold only the counts
of requests that are not in that step's list. When the list changes (a decoding engine
sends the same one step after step, ``Step.cached_same``), the requests of the old list
that are not in the new one are folded into the dictionaries: a few, not 256. A new list
sent as the one before with a few taken out and a few appended (``Step.cached_removed``,
most new lists) moves only the positions from the first one taken out, and the ones taken
out are known without looking for them.

A count is its request's entry in the latest list when it is there, else its entry in
the dictionaries (0 for neither): every write keeps that rule true.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count, filterfalse, islice

import numpy as np

_NONE: list[str] = []

ListEdit = tuple[list[str], list[int]]
"""How a step's list was made from the one before: that list, and the positions taken out
of it (ascending) before the new requests were appended (``Step.cached_removed``)."""


class TokenCounts:
    """Computed tokens of each request when it was last scheduled, and the tokens
    scheduled for it then: their sum is what it holds now."""

    def __init__(self) -> None:
        self.computed: dict[str, int] = {}
        """Requests outside the latest list: computed tokens when last scheduled..."""
        self.scheduled: dict[str, int] = {}
        """... and the tokens scheduled for them then."""
        self._ids: list[str] = _NONE
        """The latest step's requests scheduled again, as decoded (never modified)..."""
        self._computed_col: Sequence[int] = ()
        self._scheduled_col: Sequence[int] = ()
        """... their computed and scheduled tokens, in the same order (the scheduled
        column may go on with the step's new requests' counts: read up to len(_ids))..."""
        self._pos: dict[str, int] = {}
        """... and each one's position."""

    def reset(self, computed: dict[str, int]) -> None:
        """Only these computed tokens (a keyframe's), nothing scheduled."""
        self.__init__()  # type: ignore[misc]
        self.computed.update(computed)

    def __contains__(self, rid: object) -> bool:
        return rid in self._pos or rid in self.computed

    # -- writes -------------------------------------------------------------------------
    def step(self, ids: list[str], computed: Sequence[int], scheduled: Sequence[int],
             edit: ListEdit | None = None) -> None:
        """A step's counts of the requests it scheduled again: ``computed[i]`` and
        ``scheduled[i]`` are ``ids[i]``'s (``scheduled`` may be longer). ``edit``: ``ids``
        is ``edit[0]`` without the positions ``edit[1]`` (ascending), then new requests
        appended (``Step.cached_removed``); when ``edit[0]`` is the latest list, only the
        positions from the first one taken out move. ValueError when the columns are
        shorter than the list (nothing is changed then)."""
        if len(computed) != len(ids) or len(scheduled) < len(ids):
            raise ValueError(f"{len(computed)} computed and {len(scheduled)} scheduled "
                             f"counts for {len(ids)} requests")
        if ids is not self._ids:  # a new list: keep the counts of those it leaves out
            old_ids = self._ids
            if edit is not None and edit[0] is old_ids and old_ids is not _NONE:
                pos = self._pos
                removed = edit[1]
                first = len(old_ids)
                if removed:
                    gone = list(map(old_ids.__getitem__, removed))
                    self._fold(gone, removed)
                    for rid in gone:
                        pos.pop(rid, None)  # (twice the same ID: only a forged list)
                    first = removed[0]
                pos.update(zip(islice(ids, first, None), count(first)))
            else:
                pos = dict(zip(ids, range(len(ids)), strict=True))
                gone = list(filterfalse(pos.__contains__, old_ids))
                if gone:
                    self._fold(gone, list(map(self._pos.__getitem__, gone)))
                self._pos = pos
            self._ids = ids
        self._computed_col, self._scheduled_col = computed, scheduled

    def _fold(self, gone: list[str], at: list[int]) -> None:
        """The latest list's counts of ``gone`` (at positions ``at``) into the dictionaries."""
        was_c, was_s = self._computed_col, self._scheduled_col
        self.computed.update(zip(gone, map(was_c.__getitem__, at), strict=True))
        self.scheduled.update(zip(gone, map(was_s.__getitem__, at), strict=True))

    def fold(self) -> None:
        """Every count into the dictionaries; no latest list any more."""
        ids = self._ids
        if ids:
            self.computed.update(zip(ids, self._computed_col, strict=True))
            self.scheduled.update(zip(ids, self._scheduled_col, strict=False))  # to len(ids)
        self._ids, self._pos = _NONE, {}
        self._computed_col = self._scheduled_col = ()

    def set(self, rid: str, computed: int, scheduled: int | None = None) -> None:
        """One request's computed tokens (and its scheduled ones, when given)."""
        if rid in self._pos:  # never from vLLM's steps (only requests outside the list)
            self.fold()
        self.computed[rid] = computed
        if scheduled is not None:
            self.scheduled[rid] = scheduled

    def store(self, ids: list[str], computed: Sequence[int], scheduled: dict[str, int]
              ) -> None:
        """A step whose scheduled tokens came as a dict (``Step.num_scheduled``): every
        count stored; ValueError when ``computed`` does not fit ``ids``."""
        self.fold()
        self.computed.update(zip(ids, computed, strict=True))
        self.scheduled.update(scheduled)

    def drop(self, rid: str) -> None:
        """A request that left (it is never in the list of the step that says so)."""
        if rid in self._pos:  # not from vLLM; kept exact all the same
            self.fold()
        self.computed.pop(rid, None)
        self.scheduled.pop(rid, None)

    # -- reads --------------------------------------------------------------------------
    def positions_of(self, ids: list[str]) -> dict[str, int] | None:
        """Each request's position in ``ids`` when ``ids`` is the latest list (the step
        applied last), read-only; None for any other list."""
        return self._pos if ids is self._ids and ids is not _NONE else None

    def computed_of(self, rid: str) -> int:
        """Computed tokens of ``rid`` when it was last scheduled (0 unknown)."""
        i = self._pos.get(rid)
        if i is not None:
            return self._computed_col[i]
        return self.computed.get(rid, 0)

    def tokens_of(self, rid: str) -> int:
        """Tokens ``rid`` holds: computed plus scheduled when last scheduled (0 unknown)."""
        i = self._pos.get(rid)
        if i is not None:
            return self._computed_col[i] + self._scheduled_col[i]
        return self.computed.get(rid, 0) + self.scheduled.get(rid, 0)

    def tokens(self, rids: Sequence[str]) -> np.ndarray:
        """Tokens each of ``rids`` holds, in order (0 for one without a count); for a
        scrape, not per step."""
        return np.fromiter(map(self.tokens_of, rids), np.int64, len(rids))
