"""The wire contract: round trips, and every kind of bad frame is refused with a reason."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope_probe import wire


def hello(**kw: object) -> wire.Hello:
    base = dict(engine="0", session="s1", pid=1, vllm_version="0.32.0", model="tiny",
                num_blocks=8, block_size=32, kv_groups=[wire.KVGroup("FullAttentionSpec", 32)],
                token_budget=512, max_num_batched_tokens=512, max_num_seqs=4,
                policy="fcfs", prefix_caching=True, ts=1.0)
    base.update(kw)
    return wire.Hello(**base)  # type: ignore[arg-type]


def step(**kw: object) -> wire.Step:
    base = dict(ts=1.0, ops=[], new_reqs=[], num_scheduled={}, cached_ids=[], cached_computed=[],
                grown_ids=[], grown_blocks=[], resumed=[], nulled=[], relocated=[], finished=[],
                preempted=[], preemptions=[], arrivals=[], ends=[], scheduled_tokens=0,
                token_budget=512, running=0, waiting=0, head_blocks_needed=0, head_req_id="",
                free_blocks=7,
                schedule_ns=1000, probe_ns=100)
    base.update(kw)
    return wire.Step(**base)  # type: ignore[arg-type]


def frame(records: list[wire.Record], first_seq: int = 0) -> wire.Frame:
    return wire.Frame(engine="0", session="s1", first_seq=first_seq, dropped=0, faults=0,
                      records=records)


def test_round_trip_keeps_every_record_kind() -> None:
    kf = wire.Keyframe(hello=hello(), states=bytes([3, 0, 1, 2, 2, 0, 0, 0]),
                       tables={"r1": [[3, 4]]}, tokens={"r1": 40})
    s = step(ops=[(wire.OP_ALLOC, [3, 4])], new_reqs=[wire.NewReq("r1", [[3, 4]], 0)],
             num_scheduled={"r1": 40}, arrivals=[wire.Arrival("r1", 40, 16, 0, 1.0)])
    f = frame([hello(), s, kf])
    got = wire.decode(wire.encode(f))
    assert got == f
    assert isinstance(got.records[2], wire.Keyframe)


@pytest.mark.parametrize(
    ("parts", "reason"),
    [
        ([wire.VERSION_TAG], "parts"),
        ([wire.VERSION_TAG, b"x", b"y"], "parts"),
        ([b"other", b""], "tag"),
        ([b"kvscope/1", b""], "version"),  # the per-request-struct format of kvscope 0.1
        ([wire.VERSION_TAG, b"\xff\x00garbage"], "malformed"),
        ([wire.VERSION_TAG, msgspec.msgpack.encode(["0", "s", "not-an-int", 0, 0, []])],
         "malformed"),
    ],
)
def test_bad_frames_are_refused_with_a_reason(parts: list[bytes], reason: str) -> None:
    with pytest.raises(wire.WireError) as exc:
        wire.decode(parts)
    assert exc.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_escape_as_anything_but_wire_error(body: bytes) -> None:
    try:
        wire.decode([wire.VERSION_TAG, body])
    except wire.WireError:
        pass


def test_scheduled_counts_carry_the_ids_once() -> None:
    """Version 3: the counts are in the order of cached_ids then new_reqs; the sidecar
    reads the same dict as from a step that sent num_scheduled."""
    counts = step(cached_ids=["a", "b"], cached_computed=[7, 9],
                  new_reqs=[wire.NewReq("c", [[5]], 0)], scheduled_counts=[1, 1, 30])
    assert wire.scheduled_tokens_of(counts) == {"a": 1, "b": 1, "c": 30}
    plain = step(num_scheduled={"b": 1, "a": 2}, cached_ids=["a", "b"], cached_computed=[7, 9])
    assert wire.scheduled_tokens_of(plain) == {"b": 1, "a": 2}
    assert wire.scheduled_tokens_of(step()) == {}
    again = wire.decode(wire.encode(frame([counts]))).records[0]
    assert wire.scheduled_tokens_of(again) == {"a": 1, "b": 1, "c": 30}


@pytest.mark.parametrize("bad", [
    dict(cached_ids=["a"], cached_computed=[1], scheduled_counts=[1, 1]),  # one too many
    dict(cached_ids=["a", "b"], cached_computed=[1, 1], scheduled_counts=[1]),
    dict(cached_ids=["a"], cached_computed=[1], num_scheduled={"a": 1}, scheduled_counts=[1]),
])
def test_counts_that_do_not_fit_their_requests_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="scheduled"):
        wire.scheduled_tokens_of(step(**bad))


def test_frames_of_older_probes_still_decode_and_other_versions_do_not() -> None:
    """An engine whose probe is a release or two behind keeps being read: a version-2 step
    has no scheduled_counts, a version-3 step no cached_removed (the field is absent from
    its array, not nil), a version-4 keyframe no pending requests."""
    body = wire.encode(frame([step(num_scheduled={"a": 3}, cached_ids=["a"],
                                   cached_computed=[1])]))[1]
    got = wire.decode([b"kvscope/2", body]).records[0]
    assert wire.scheduled_tokens_of(got) == {"a": 3}
    raw = msgspec.msgpack.decode(body)
    assert raw[5][0][-1] is None  # cached_removed, the last field of a step
    raw[5][0] = raw[5][0][:-1]  # as a version-3 probe sends it
    got = wire.decode([b"kvscope/3", msgspec.msgpack.encode(raw)]).records[0]
    assert got.cached_removed is None and got.cached_ids == ["a"]
    # a version-4 keyframe has no pending requests: every table is in it
    kf = wire.Keyframe(hello=hello(num_blocks=2), states=b"\x03\x00", tables={}, tokens={})
    raw = msgspec.msgpack.decode(wire.encode(frame([kf]))[1])
    assert raw[5][0][-1] == []  # pending, the last field of a keyframe
    raw[5][0] = raw[5][0][:-1]
    got = wire.decode([b"kvscope/4", msgspec.msgpack.encode(raw)]).records[0]
    assert isinstance(got, wire.Keyframe) and got.pending == []
    for tag in (b"kvscope/6", b"kvscope/1"):
        with pytest.raises(wire.WireError) as err:
            wire.decode([tag, body])
        assert err.value.reason == "version"


NAMES = [f"q{i}" for i in range(12)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(NAMES), unique=True, max_size=10),
       st.sets(st.integers(0, 9), max_size=4), st.lists(st.sampled_from(NAMES), max_size=4),
       st.lists(st.sampled_from(NAMES), max_size=3), st.booleans())
def test_a_list_sent_as_an_edit_is_rebuilt_exactly(prev: list[str], out: set[int],
                                                   appended: list[str], others: list[str],
                                                   shuffle: bool) -> None:
    """Version 4: the probe sends a step's list as the previous one with positions taken
    out and a tail appended only when that rebuilds the list vLLM gave it, exactly; a list
    made so (requests ended, others started) is always sent so."""
    removed = sorted(i for i in out if i < len(prev))
    kept = [rid for i, rid in enumerate(prev) if i not in removed]
    ids = kept + [rid for rid in dict.fromkeys(appended) if rid not in kept]
    if shuffle:  # any other list: an edit only when it is one
        ids = sorted(ids, key=lambda rid: NAMES.index(rid) * 7 % 12)
    # what finished or was preempted: those taken out, and requests never in the list (one
    # aborted while it waited); one still listed makes the cut fail its check (next test)
    gone = [prev[i] for i in removed] + [rid for rid in others if rid not in prev + ids]
    cut = wire.cached_edit(list(prev), ids, gone)
    # many ended at once (a mass abort: a dict of positions, not a scan per request)
    assert wire.cached_edit(list(prev), ids, gone + [f"absent-{i}" for i in range(20)]) == cut
    if not shuffle and (removed or ids[:len(prev)] == prev):
        assert cut is not None
    if cut is not None:
        tail = ids[len(prev) - len(cut):]
        assert wire.apply_cached_edit(list(prev), cut, tail) == ids
        assert cut == sorted(set(cut))


def test_a_cut_that_does_not_rebuild_the_list_is_not_sent() -> None:
    """A request named gone that is still listed (or any other list): the whole list."""
    prev = ["a", "b", "c"]
    assert wire.cached_edit(prev, ["b", "c", "d"], {"a"}) == [0]
    assert wire.cached_edit(prev, ["b", "c", "d"], {"a", "b"}) is None
    assert wire.cached_edit(prev, ["a", "b", "c", "d"], {"x"}) == []
    assert wire.cached_edit(prev, ["c", "b"], {"a"}) is None
    assert wire.cached_edit(prev, ["b"], set()) is None


@pytest.mark.parametrize("removed", [[1, 0], [0, 0], [3], [-1], [0, 2, 2]])
def test_an_edit_outside_the_list_before_is_refused(removed: list[int]) -> None:
    with pytest.raises(ValueError, match="not ascending within"):
        wire.apply_cached_edit(["a", "b", "c"], removed, ["d"])


def test_apply_cached_edit_takes_out_exactly_the_positions() -> None:
    prev = [f"r{i}" for i in range(1000)]
    removed = list(range(0, 1000, 3)) + [999] if 999 % 3 else list(range(0, 1000, 3))
    got = wire.apply_cached_edit(prev, removed, ["t"])
    assert got == [r for i, r in enumerate(prev) if i % 3 and i != 999] + ["t"]
    assert prev == [f"r{i}" for i in range(1000)]  # the previous list is not changed
    assert wire.apply_cached_edit(prev, [], []) == prev
    assert wire.apply_cached_edit(prev, list(range(1000)), ["z"]) == ["z"]
