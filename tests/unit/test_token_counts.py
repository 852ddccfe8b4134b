"""TokenCounts keeps the latest step's lists and reads through them: every read must equal
what two dictionaries updated with every count (the ledger before it) would say."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.state.token_counts import TokenCounts

RIDS = [f"r{i}" for i in range(8)]


class Reference:
    """The ledger's counts as they were: every count stored in two dictionaries."""

    def __init__(self) -> None:
        self.computed: dict[str, int] = {}
        self.scheduled: dict[str, int] = {}

    def step(self, ids: list[str], computed: list[int], scheduled: list[int]) -> None:
        self.computed.update(zip(ids, computed, strict=True))
        self.scheduled.update(zip(ids, scheduled, strict=False))

    def tokens_of(self, rid: str) -> int:
        return self.computed.get(rid, 0) + self.scheduled.get(rid, 0)


ops = st.lists(st.one_of(
    st.tuples(st.just("step"), st.lists(st.sampled_from(RIDS), unique=True, max_size=6),
              st.integers(0, 3)),
    st.tuples(st.just("same"), st.integers(0, 99)),
    st.tuples(st.just("edit"), st.sets(st.integers(0, 7), max_size=3),
              st.lists(st.sampled_from(RIDS), unique=True, max_size=3), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.sampled_from(RIDS)),
    st.tuples(st.just("set"), st.sampled_from(RIDS), st.integers(0, 99)),
    st.tuples(st.just("dict"), st.lists(st.sampled_from(RIDS), unique=True, max_size=6),
              st.integers(0, 9)),
), max_size=40)


@settings(max_examples=400, deadline=None)
@given(ops)
def test_every_read_equals_the_dictionaries_of_every_count(program: list[tuple]) -> None:
    got, ref = TokenCounts(), Reference()
    ids: list[str] = []
    for n, op in enumerate(program):
        if op[0] in ("step", "same", "edit"):
            edit = None
            if op[0] == "step":
                ids = list(op[1])  # a new list object, as a decoded step brings
            elif op[0] == "edit":  # the list before, some taken out, some appended
                removed = sorted(i for i in op[1] if i < len(ids))
                kept = [rid for i, rid in enumerate(ids) if i not in removed]
                edit = (ids, removed)  # the list before may not be the counts' latest
                ids = kept + [rid for rid in op[2] if rid not in kept]
            extra = op[2] if op[0] == "step" else op[3] if op[0] == "edit" else 1
            computed = [100 * n + i for i in range(len(ids))]
            scheduled = [n % 5 + i for i in range(len(ids) + extra)]
            got.step(ids, computed, scheduled, edit)  # "same": the very list object again
            ref.step(ids, computed, scheduled)
        elif op[0] == "drop":
            got.drop(op[1])
            ref.computed.pop(op[1], None)
            ref.scheduled.pop(op[1], None)
        elif op[0] == "set":
            got.set(op[1], op[2], 0)
            ref.computed[op[1]] = op[2]
            ref.scheduled[op[1]] = 0
        else:  # a step in the dict form: its requests' counts, and a dict of scheduled ones
            ids = list(op[1])
            computed = [100 * n + i for i in range(len(ids))]
            scheduled = {rid: op[2] + i for i, rid in enumerate(reversed(ids))}
            got.store(ids, computed, scheduled)
            ref.computed.update(zip(ids, computed, strict=True))
            ref.scheduled.update(scheduled)
        for rid in RIDS:
            assert got.tokens_of(rid) == ref.tokens_of(rid), (rid, program[: n + 1])
            assert got.computed_of(rid) == ref.computed.get(rid, 0)
            assert (rid in got) == (rid in ref.computed)
        assert got.tokens(RIDS).tolist() == [ref.tokens_of(r) for r in RIDS]


def test_a_request_left_out_of_the_next_list_keeps_its_counts() -> None:
    """A running request not scheduled in a step keeps what it held (folded when the
    list changes), the others are read from the newest list."""
    c = TokenCounts()
    c.step(["a", "b", "c"], [10, 20, 30], [1, 1, 1, 50])
    c.step(["a", "c"], [11, 31], [1, 1])
    assert [c.tokens_of(r) for r in "abc"] == [12, 21, 32]
    assert c.computed == {"b": 20} and c.scheduled == {"b": 1}  # only the one left out
    same = ["a", "c"]
    c.step(same, [12, 32], [1, 1])
    c.step(same, [13, 33], [2, 2])  # the same list object: nothing is folded
    assert [c.tokens_of(r) for r in "abc"] == [15, 21, 35] and c.computed == {"b": 20}


def test_short_columns_change_nothing() -> None:
    c = TokenCounts()
    c.step(["a"], [5], [1])
    for ids, computed, scheduled in ((["b", "c"], [1], [1, 1]), (["b"], [1], []),
                                     (["b"], [], [1]), (["a"], [1, 2], [1, 1])):
        with pytest.raises(ValueError, match="counts for"):
            c.step(ids, computed, scheduled)
    assert c.tokens_of("a") == 6 and "b" not in c
