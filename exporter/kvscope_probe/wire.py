"""The versioned contract between the probe (inside vLLM) and the sidecar.

A frame travels as a two-part ZMQ message: ``[VERSION_TAG, msgpack(Frame)]``. The
receiver checks the tag before decoding, so a frame of another version is rejected
cheaply and counted; a malformed body is rejected and counted too. Nothing here
knows about Prometheus, ClickHouse or HTTP.

Block operations are recorded in the order vLLM's ``BlockPool`` performed them;
replaying them in order rebuilds the exact free set (unordered sets do not).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Union

import msgspec

WIRE_VERSION = 5
VERSION_TAG = b"kvscope/5"
ACCEPTED_TAGS = frozenset({b"kvscope/2", b"kvscope/3", b"kvscope/4", VERSION_TAG})
"""Version 3 may send a step's scheduled tokens as ``Step.scheduled_counts`` and its
``cached_ids`` as "the previous step's" (``Step.cached_same``); version 4 also as the
previous step's with some taken out and some appended (``Step.cached_removed``). Frames of
an older probe decode the same (the fields are absent). An older sidecar refuses a newer
version by its tag rather than read an empty ``num_scheduled`` or a list's tail as the
whole list. Version 5 may send a large pool's keyframe across steps (``Keyframe.pending``,
``KeyframeTables``)."""

# Block operation kinds (first element of an op tuple).
OP_ALLOC = 0  # free -> used (get_new_blocks, touch of a free block)
OP_FREE = 1  # used -> free, no prefix-cache hash (reused first)
OP_FREE_CACHED = 2  # used -> free, still holds a prefix-cache hash (evictable)
OP_UNCACHE = 3  # free+cached -> free (hash evicted without allocation)
OP_UNCACHE_ALL = 4  # every free+cached block -> free (prefix cache reset)

# Per-block states in a keyframe and in the sidecar's ledger.
STATE_FREE = 0
STATE_CACHED = 1  # free, evictable prefix-cache block
STATE_USED = 2
STATE_NULL = 3  # block 0, vLLM's null block, never free

REASONS = ("kv_full", "priority", "unknown")

END_STATUSES = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_ABORTED",
                          "FINISHED_IGNORED", "FINISHED_ERROR", "FINISHED_REPETITION"})
"""vLLM's finished ``RequestStatus`` names (``End.status``); the sidecar counts any other
status as ``other``, so a probe's strings never become unbounded metric labels."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks of size ``b`` that ``a`` tokens occupy (both sides
    count blocks this way)."""
    return -(-a // b)


class KVGroup(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One KV cache group of the engine (a plain model has one)."""

    kind: str
    """Spec class name, for example ``FullAttentionSpec``."""
    block_size: int
    """Tokens per block in this group."""
    sliding_window: int = 0
    """Tokens a sliding-window group attends to (its spec's ``sliding_window``); 0 for
    other kinds, and in frames of probes before it."""


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True, gc=False):
    """Static facts about one engine, sent first and inside every keyframe."""

    engine: str
    """Engine label: ``KVSCOPE_ENGINE`` or the data-parallel index (vLLM's ``engine``)."""
    session: str
    """Random ID of this probe instance; a new one means the engine restarted."""
    pid: int
    """EngineCore process ID."""
    vllm_version: str
    model: str
    num_blocks: int
    """Blocks in the pool, including the null block 0."""
    block_size: int
    kv_groups: list[KVGroup]
    token_budget: int
    """Tokens one step may schedule (max_num_scheduled_tokens)."""
    max_num_batched_tokens: int
    max_num_seqs: int
    policy: str
    prefix_caching: bool
    ts: float
    server: str = ""
    """Which vLLM server: ``KVSCOPE_SERVER`` or its API server's host:port; "" for an
    engine outside an API server (kvscope_probe.identity)."""
    dp_rank: int = -1
    """The data-parallel index vLLM gave this engine (-1 unknown)."""
    started: float = 0.0
    """Epoch seconds at which the EngineCore process started (0.0 unknown): lets the
    sidecar check the PID only when it sees this very process."""
    disabled: dict[str, str] = {}
    """{feature: why} the probe does not record on this vLLM (``kvscope_probe.fingerprint``);
    absent in frames of probes before it, which decode as nothing disabled."""
    max_model_len: int = 0
    """The scheduler's ``max_model_len`` (0 unknown: frames of probes before it)."""
    async_scheduling: bool = False
    """Whether the scheduler is vLLM's ``AsyncScheduler`` (one step in flight)."""
    spec_tokens: int = 0
    """Speculative tokens a step (the scheduler's ``num_spec_tokens``; 0 none)."""
    watermark_blocks: int = 0
    """Free blocks vLLM keeps from a waiting or preempted request while any request runs
    (``--watermark`` x the pool; the KV cache manager's ``watermark_blocks``); 0: none,
    or a probe before it."""


class Preemption(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Facts recorded just before vLLM freed a victim's blocks."""

    victim: str
    victim_blocks: int
    """Blocks the victim held (all KV groups; prefix blocks it shared counted, the null
    placeholders a sliding-window or Mamba group keeps in its table not)."""
    victim_priority: int
    computed_tokens_lost: int
    """The victim's computed tokens, discarded by the preemption."""
    free_blocks: int
    """Pool's free blocks (evictable cached ones included) just before."""
    op_index: int
    """Number of this step's ops that precede the preemption."""
    requester: str | None
    """Request whose block allocation failed, when one did."""
    requester_priority: int | None
    blocks_needed: int | None
    """Blocks that allocation needed."""
    policy: str
    reason: str
    """One of REASONS, derived from the facts above (kvscope_probe.reasons)."""
    ts: float


class Arrival(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request entered the scheduler. Lengths only: never token IDs or text."""

    req_id: str
    prompt_len: int
    max_tokens: int
    priority: int
    arrival_time: float


class End(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request left the scheduler (finished or aborted)."""

    req_id: str
    status: str
    """vLLM RequestStatus name, for example FINISHED_LENGTH_CAPPED."""
    prompt_len: int
    output_len: int
    num_preemptions: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache at first admission (-1 unknown)."""
    ts: float


class NewReq(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request scheduled for the first time in this step (few per step)."""

    req_id: str
    block_ids: list[list[int]]
    """Its whole block table, one list per KV group (null placeholders are block 0)."""
    computed_tokens: int
    """Tokens already computed before this step (prefix-cache hits)."""


class Nulled(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Blocks a KV group replaced by the null block in one request's table and released
    (a sliding window moving on: ``_remove_blocks_in_range``)."""

    req_id: str
    group: int
    block_ids: list[int]


class Audit(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One slice of vLLM's own pool, read after a step, to check the sidecar's ledger
    against vLLM rather than against the probe's mirror (``PoolMirror.audit``)."""

    lo: int
    """First block of the slice..."""
    states: bytes
    """... and the state of each of its blocks read from vLLM's ``BlockPool.blocks``
    (``ref_cnt``, the prefix-cache hash, the null flag), one STATE_* byte each."""
    mirror_fixed: int
    """Blocks of this slice the probe's own mirror had wrong (set right from vLLM's)."""
    req_id: str
    """A running request whose block table follows ("" when none runs)..."""
    table: list[list[int]]
    """... as vLLM's manager holds it, one list per KV group (``get_block_ids``)."""


class Step(msgspec.Struct, tag="step", array_like=True, frozen=True, gc=False):
    """One ``Scheduler.schedule()`` call and what happened since the previous one.

    Columnar: what every scheduled request contributes is a dict entry and a list slot
    copied by the probe in bulk, never a struct per request; block-table changes come only
    for the requests whose tables changed.
    """

    ts: float
    ops: list[tuple[int, list[int]]]
    """Ordered block operations: (OP_*, block IDs)."""
    new_reqs: list[NewReq]
    num_scheduled: dict[str, int]
    """Tokens scheduled this step per request (new and running ones); empty when
    ``scheduled_counts`` carries them (read both through ``scheduled_tokens_of``)."""
    cached_ids: list[str]
    """Requests scheduled again (running on, or resumed after preemption)..."""
    cached_computed: list[int]
    """... and their computed tokens before this step, in the same order."""
    grown_ids: list[str]
    """Scheduled-again requests whose tables grew (or, when resumed, were rebuilt)..."""
    grown_blocks: list[list[list[int]]]
    """... their new blocks per group (the whole table for a resumed one)."""
    resumed: list[str]
    """Requests resumed after a preemption in this step."""
    nulled: list[Nulled]
    """Table entries replaced by the null block, applied before the tables grow."""
    relocated: list[Nulled]
    """Blocks moved to the end of their table, the null block left in their place (a
    Mamba group's speculative scratch blocks, prefix caching on). Only their old place is
    here: vLLM reports the moved block among the step's new blocks of that request."""
    finished: list[str]
    preempted: list[str]
    preemptions: list[Preemption]
    arrivals: list[Arrival]
    ends: list[End]
    scheduled_tokens: int
    token_budget: int
    running: int
    waiting: int
    """Waiting requests as vLLM counts them (requests holding KV while waiting included)."""
    head_blocks_needed: int
    """Blocks the head of the waiting queue needs for its whole current sequence and
    vLLM's speculative lookahead (at most ``max_model_len`` tokens), in every KV group,
    before prefix-cache hits (an upper bound); 0 when nothing waits. The head is the one
    vLLM's loop takes first: a request holding KV blocks while waiting, else the waiting
    queue's; 0 too while vLLM skips it for a reason other than blocks (its
    ``deferred_waiting``: a grammar compiling, a KV load, streaming input)."""
    head_req_id: str
    """The request at the head of the waiting queue ("" when nothing waits, or vLLM skips
    it for a reason other than blocks)."""
    free_blocks: int
    """The pool's own free count after the step, a check for the ledger."""
    schedule_ns: int
    """Time spent in vLLM's schedule()."""
    probe_ns: int
    """Engine-thread time the probe spent since the previous step: its step record and
    the block-pool wrappers' handlers, timed, plus the untimed call layers (the
    ``get_new_blocks`` wrapper, the armed blocks-needed hook) as calls x a cost measured
    once at attach (``kvscope_probe.calibrate``)."""
    rolled_back: dict[str, int] = {}
    """Computed tokens of running requests NOT scheduled this step that had draft tokens
    in one of the last two steps: vLLM lowers a request's count when it rejects drafts
    (``update_from_output``, after the step was recorded), and one that is not scheduled
    again would otherwise keep the count from before the rejection."""
    audit: Audit | None = None
    """A slice of vLLM's pool and one request's table, read after this step."""
    scheduled_counts: list[int] = []
    """Tokens scheduled this step per request, in the order of ``cached_ids`` then
    ``new_reqs``: sent instead of ``num_scheduled`` when vLLM's own dict lists exactly those
    requests in that order (the probe compares the two before it sends this form), so a
    step's ~256 request IDs travel once, not twice."""
    cached_same: bool = False
    """``cached_ids`` is empty because it is the previous step record's list again (a
    decoding engine schedules the same running requests in the same order step after
    step). The probe sends the whole list after every keyframe, every record it dropped and
    every contained fault, so a sidecar that missed a record is stale (and says so) only
    until the next keyframe. Read the step through ``EngineState``, which resolves it."""
    cached_removed: list[int] | None = None
    """When set, ``cached_ids`` holds only the requests appended to the previous step
    record's list after the requests at these positions (ascending) left it: a decoding
    engine's list changes by a request ending or one starting (``cached_edit``). None:
    ``cached_ids`` is the whole list (or ``cached_same``). Resolved like ``cached_same``."""


class Keyframe(msgspec.Struct, tag="keyframe", array_like=True, frozen=True, gc=False):
    """Full pool state after the preceding step, copied from the probe's mirror."""

    hello: Hello
    states: bytes
    """One byte per block: STATE_*."""
    tables: dict[str, list[list[int]]]
    """Block table of every running request but the ``pending`` ones, one list per KV
    group."""
    tokens: dict[str, int]
    """Computed tokens of every running request (``pending`` ones included)."""
    pending: list[str] = []
    """Running requests whose tables are not in ``tables`` but follow, read at the end of
    the next steps, in ``KeyframeTables`` records (a keyframe reads at most
    ``recorder.KEYFRAME_SLICE_BLOCKS`` of vLLM's block tables a step, so its pause on the
    engine thread does not grow with the pool). [] when ``tables`` holds them all, as in
    frames of probes before it."""


class KeyframeTables(msgspec.Struct, tag="keyframe_tables", array_like=True, frozen=True,
                     gc=False):
    """More tables of the keyframe before it, each read from vLLM at the end of the step
    recorded just before this record (so the steps between have changed them already):
    those of its ``pending`` requests that still hold blocks."""

    tables: dict[str, list[list[int]]]
    last: bool
    """No table of that keyframe follows."""


class ClientStart(msgspec.Struct, tag="client_start", array_like=True, frozen=True, gc=False):
    """An API request seen by kvscope's middleware in vLLM's API server, before vLLM.

    Identity and digests only: never prompt text, never the API key. The digests are
    unkeyed; the sidecar keys them with its secret before it stores, compares or labels
    anything, so they exist only in the API server's memory and on this socket."""

    request_id: str
    """The request's ID as vLLM uses it (engine IDs embed it): the caller's X-Request-Id,
    else the body's ``request_id``, else one the middleware set (``kvs<32 hex>``); one
    longer than 128 characters travels as ``sha256:<hex>`` of itself."""
    ts: float
    endpoint: str
    """completions or chat."""
    model: str
    client_id: str
    user_agent: str
    api_key_sha256: str
    """SHA-256 (hex) of the bearer API key, "" without one."""
    prompt_sha256: str
    """SHA-256 (hex) of the canonical prompt or messages."""
    prompt_chars: int
    max_tokens: int
    """-1 when the request did not say."""
    call_id: str = ""
    """Unique per HTTP call, shared by its ClientEnd (a caller may reuse a request ID);
    "" from a middleware that predates it: pair on request_id."""


class ClientEnd(msgspec.Struct, tag="client_end", array_like=True, frozen=True, gc=False):
    """The HTTP answer to a request the middleware saw start."""

    request_id: str
    ts: float
    status: int
    duration_s: float
    call_id: str = ""
    """The call_id of its ClientStart."""


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True, frozen=True, gc=False):
    """Liveness, sent by the probe's sender thread (never the engine thread) while no
    other record has been sent for a while: an idle engine stays "connected".

    Heartbeats stand outside the record sequence: a frame that holds only heartbeats
    does not advance ``first_seq`` (its ``first_seq`` is the next record's number)."""

    ts: float
    since_step_s: float
    """Seconds since the engine's last ``schedule()`` call; -1 before the first."""
    unfinished: int = -1
    """vLLM's own count of the requests it would step for
    (``Scheduler.get_num_unfinished_requests``: 0 while paused with ``keep``, sessions
    waiting for streaming input left out); vLLM's engine loop does not call
    ``schedule()`` while it is 0. Read by the sender thread; -1 unknown (a probe before
    it, or the read failed)."""


Record = Union[Hello, Step, Keyframe, KeyframeTables, Heartbeat, ClientStart, ClientEnd]  # noqa: UP007 - msgspec, 3.10


CLIENT_ENGINE_PREFIX = "api:"
"""Frames whose engine starts with this come from the API-server middleware."""


class Frame(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A batch of consecutive records from one probe (or from the middleware)."""

    engine: str
    session: str
    first_seq: int
    """Sequence number of records[0]; records are numbered consecutively."""
    dropped: int
    """Records this probe dropped so far (ring full or sidecar not keeping up)."""
    faults: int
    """Exceptions the probe caught and contained so far."""
    records: list[Record]
    sender_cpu_ns: int = 0
    """CPU time the probe's sender thread has used so far (0 from the middleware)."""
    io_cpu_ns: int = 0
    """CPU time libzmq's threads for the probe's socket have used so far (0: unknown)."""
    ring_bytes: int = 0
    """Encoded records the probe holds in the engine process, not yet in this frame or
    its socket, when the frame was made..."""
    ring_limit_bytes: int = 0
    """... and the bound of that ring (0 from the middleware)."""


class WireError(ValueError):
    """A frame that cannot be accepted; ``reason`` is a bounded label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(frame: Frame) -> list[bytes]:
    """The multipart message for one frame."""
    return [VERSION_TAG, _encoder.encode(frame)]


def cached_edit(prev: list[str], ids: list[str], gone: Collection[str]) -> list[int] | None:
    """The probe's side of ``Step.cached_removed``: the positions in ``prev`` of the requests
    of ``gone`` (those that finished or were preempted) that make ``prev`` without them the
    head of ``ids``, ``[]`` when ``prev`` is its head already; None when ``ids`` is not so
    made (then the whole list is sent). Checked against ``ids`` itself, never assumed: the
    sidecar rebuilds the list from it exactly (``apply_cached_edit``)."""
    n = len(prev)
    if len(ids) >= n and ids[:n] == prev:  # only appended (identity compares in C)
        return []
    cut: set[int] = set()
    if len(gone) > 16:  # many ended at once (a mass abort of queued requests): one dict,
        at = {rid: i for i, rid in enumerate(prev)}  # not a scan of prev for each
        cut.update(i for i in map(at.get, gone) if i is not None)
    else:
        for rid in gone:
            try:
                cut.add(prev.index(rid))
            except ValueError:  # not in the previous list
                continue
    if not cut:
        return None
    removed = sorted(cut)
    head = _without(prev, removed)
    return removed if ids[:len(head)] == head else None


def apply_cached_edit(prev: list[str], removed: list[int], tail: list[str]) -> list[str]:
    """The sidecar's side: ``prev`` without the positions ``removed``, then ``tail``;
    ValueError when the positions are not ascending within ``prev``."""
    last = -1
    for i in removed:
        if not last < i < len(prev):
            raise ValueError(f"cached_removed {removed[:8]} is not ascending within "
                             f"the previous list of {len(prev)}")
        last = i
    ids = _without(prev, removed)
    ids += tail
    return ids


_DELETE_AT_MOST = 64
"""Positions taken out one by one at most (each moves the tail, at C speed); more, in one
pass over ``items`` (a Python loop: ~25 k instructions at 256 running, every step)."""


def _without(items: list[str], positions: list[int]) -> list[str]:
    """A copy of ``items`` without the ascending ``positions`` (both sides of the edit).
    A step's few (a request or two ended) are deleted one by one; a forged frame's
    thousands in one pass, never thousands of tail moves."""
    if len(positions) <= _DELETE_AT_MOST:
        out = items.copy()
        for i in reversed(positions):
            del out[i]
        return out
    cut = set(positions)
    return [r for i, r in enumerate(items) if i not in cut]


def scheduled_ids(s: Step) -> list[str]:
    """The requests ``scheduled_counts`` is for, in its order (``cached_ids``, then the new
    requests); raises ValueError when the counts do not match them."""
    if s.num_scheduled:
        raise ValueError("a step with both num_scheduled and scheduled_counts")
    ids = s.cached_ids + [r.req_id for r in s.new_reqs] if s.new_reqs else s.cached_ids
    if len(ids) != len(s.scheduled_counts):
        raise ValueError(f"{len(s.scheduled_counts)} scheduled counts for {len(ids)} requests")
    return ids


def scheduled_tokens_of(s: Step) -> dict[str, int]:
    """The step's scheduled tokens per request, whichever form the probe sent; raises
    ValueError when the counts do not match the requests they are for."""
    if not s.scheduled_counts:
        return s.num_scheduled
    return dict(zip(scheduled_ids(s), s.scheduled_counts, strict=True))


def decode(parts: list[bytes]) -> Frame:
    """Validate and decode a multipart message; raise WireError when it is not ours."""
    if len(parts) != 2:
        raise WireError("parts", f"expected 2 message parts, got {len(parts)}")
    tag, body = parts
    if tag not in ACCEPTED_TAGS:
        if tag.startswith(b"kvscope/"):
            raise WireError("version", f"unsupported wire version {tag[:32]!r}")
        raise WireError("tag", "not a kvscope frame")
    try:
        return _decoder.decode(body)
    except Exception as exc:  # noqa: BLE001 - msgspec also raises e.g. UnicodeDecodeError
        raise WireError("malformed", f"{type(exc).__name__}: {str(exc)[:200]}") from None
