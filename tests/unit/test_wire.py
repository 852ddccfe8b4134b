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


def test_a_version_2_frame_still_decodes_and_other_versions_do_not() -> None:
    """An engine whose probe is a release behind (version 2) keeps being read; its steps
    have no scheduled_counts."""
    body = wire.encode(frame([step(num_scheduled={"a": 3}, cached_ids=["a"],
                                   cached_computed=[1])]))[1]
    got = wire.decode([b"kvscope/2", body]).records[0]
    assert wire.scheduled_tokens_of(got) == {"a": 3}
    for tag in (b"kvscope/4", b"kvscope/1"):
        with pytest.raises(wire.WireError) as err:
            wire.decode([tag, body])
        assert err.value.reason == "version"
