"""The rows kvscope stores: plain dataclasses, one per table, no store imports.

Times are epoch seconds (float) taken in the engine process (the probe's clock), so every
interval below is computed from timestamps of one process. Sentinels instead of NULL:
``-1`` for an unknown count or time, ``""`` for an unknown string.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import MISSING, dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """One row per request when it ends (table ``request_traces``)."""

    ts: float
    """When the request ended."""
    model: str
    engine: str
    request_id: str
    prompt_len: int
    max_gen_len: int
    """max_tokens as the engine received it (-1 unknown: the sidecar did not see the
    request arrive, having taken the engine up after it was queued)."""
    output_len: int
    required_blocks: int
    """cdiv(prompt + output, block_size) summed over every KV cache group: its blocks at the
    full length where each group keeps every block (full attention does; sliding-window and
    Mamba groups hold fewer: ``allocated_blocks`` is what it took)."""
    allocated_blocks: int
    """Most blocks the request held at once; from its keyframe table on for a request
    running when the sidecar took the engine up (a finished request's last table is its
    largest in a full-attention group), -1 when it ended before that table was heard."""
    contiguous_allocated: bool
    """Its last block table was one run of consecutive block IDs."""
    block_fragments: int
    """Runs of consecutive IDs in its last block table (1 = contiguous)."""
    preempt_count: int
    preempt_reason: str
    """Reason of its last preemption, "" if never preempted."""
    recomputed_tokens: int
    """Tokens discarded by its preemptions and computed again (-1 unknown: preempted
    before the sidecar took the engine up)."""
    cached_tokens: int
    """Prompt tokens served by the prefix cache at first admission."""
    free_blocks_at_alloc: int
    """Free blocks right after the step that first admitted it (-1 unknown)."""
    max_contiguous_free_blocks_at_alloc: int
    """Longest run of consecutive free block IDs around that step: the sidecar samples it
    at most 0.1 s apart, as scanning the pool on every admitting step would cost more
    than the rest of the step (-1 unknown)."""
    arrival_ts: float
    """When the engine received it. When the sidecar did not see it arrive (it took the
    engine up later), the latest it can have arrived: its first admission's time, or for
    a request already admitted then, the first step heard after the keyframe that showed
    it running (its resume's, for one waiting after a preemption); then the three times
    below, ``max_gen_len`` and the two ``_at_alloc`` figures are -1."""
    queue_seconds: float
    """Arrival to first admission (-1 never admitted, or the arrival not seen)."""
    first_token_seconds: float
    """Arrival to the step that finished its prefill (-1 never, or the arrival not seen)."""
    e2e_seconds: float
    """Arrival to its end (-1 the arrival not seen)."""
    finish_reason: str
    """vLLM status: FINISHED_STOPPED, FINISHED_LENGTH_CAPPED, FINISHED_ABORTED, ..."""
    client_id: str = ""
    user_agent: str = ""
    api_key_hash: str = ""
    prompt_hash: str = ""
    server: str = ""
    """The engine's vLLM server (kvscope_probe.identity); "" outside an API server."""


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """One row per lifecycle event of a request (table ``request_events``)."""

    ts: float
    model: str
    engine: str
    request_id: str
    event: str
    """queued, admitted, allocated, preempted, resumed, finished, aborted; taken_up: the
    request was running (holding ``total_blocks``) when this sidecar took the engine up,
    admitted before it heard the engine (``RequestTracker._take_up``)."""
    step: int
    """Engine step counter when it happened (0: between steps)."""
    blocks: int
    """Blocks this event concerns: admitted/resumed the table, allocated the new blocks,
    preempted the victim's blocks (-1 not applicable)."""
    total_blocks: int
    """Blocks the request holds after the event (-1 unknown)."""
    free_blocks: int
    max_contiguous_free: int
    tokens: int
    """Computed tokens after the event (preempted: tokens discarded)."""
    reason: str = ""
    detail: str = ""
    """``key=value`` facts: preempted ``requester= blocks_needed=``; queued ``position=``
    (order among the step's arrivals as the scheduler queued them) ``priority=``. For people
    to read: a request ID may hold spaces and ``=``, so ``requester`` is read from its own
    field."""
    server: str = ""
    """The engine's vLLM server (kvscope_probe.identity); "" outside an API server."""
    requester: str = ""
    """preempted: the request whose allocation failed (vLLM's ID as it is), "" when the
    probe did not say or in a row written before the column (its ``detail`` says it)."""
    step_counter: str = ""
    """Which sidecar count ``step`` is of (``EngineState.step_counter``): a sidecar that
    takes up an engine mid-run (it restarted) counts its steps from 1 again under a new
    name, so steps compare only within one name; "" in a row written before the column."""


@dataclass(frozen=True, slots=True)
class RequestAllocations:
    """A request's block allocations, one array entry each (table ``request_allocations``).

    One row per request per run of allocations: the tracker writes it when the request
    is preempted or ends, and every 5 s of engine time while it keeps growing. Each
    entry is what one ``allocated`` RequestEvent held; ``events()`` gives them back."""

    ts: float
    """The first allocation's time."""
    model: str
    engine: str
    request_id: str
    step: list[int]
    offset_ms: list[int]
    """Each allocation's time in milliseconds after ``ts`` (the store keeps ms)."""
    blocks: list[int]
    """Blocks each allocation added; negative: blocks a sliding-window group gave back
    (they left its window), so ``total_blocks`` follows what the request holds."""
    total_blocks: list[int]
    free_blocks: list[int]
    tokens: list[int]
    server: str = ""
    """The engine's vLLM server (kvscope_probe.identity); "" outside an API server."""
    step_counter: str = ""
    """Which sidecar count ``step`` is of (``RequestEvent.step_counter``)."""

    def events(self) -> list[RequestEvent]:
        """The ``allocated`` events this row holds, as request_events_all reads them."""
        ms0 = epoch_ms(self.ts)
        return [RequestEvent(ts=(ms0 + dt) / 1000.0, model=self.model, engine=self.engine,
                             request_id=self.request_id, event="allocated", step=step,
                             blocks=blocks, total_blocks=total, free_blocks=free,
                             max_contiguous_free=-1, tokens=tokens, server=self.server,
                             step_counter=self.step_counter)
                for step, dt, blocks, total, free, tokens in zip(
                    self.step, self.offset_ms, self.blocks, self.total_blocks,
                    self.free_blocks, self.tokens, strict=True)]


def epoch_ms(ts: float) -> int:
    """Epoch seconds to the milliseconds the store keeps (``store.arrow`` rounds the same
    way: half to even on the same float product)."""
    return round(ts * 1000.0)


def unrolled(rows: Iterable[Any]) -> Iterator[Any]:
    """``rows`` with each RequestAllocations replaced by its ``allocated`` events."""
    for row in rows:
        if type(row) is RequestAllocations:
            yield from row.events()
        else:
            yield row


@dataclass(frozen=True, slots=True)
class SchedulerDecision:
    """A decision worth reading (table ``scheduler_decisions`` and the decision log)."""

    ts: float
    model: str
    engine: str
    decision: str
    """preempt, admission_blocked, never_fits, resume, finish, abort, error."""
    request_id: str
    reason: str
    """preempt: kv_full, priority or unknown; admission_blocked: the limit vLLM's waiting
    loop met first (``rollups.admission_limit``): preempted, token_budget, max_num_seqs or
    kv_blocks; "" for the others."""
    blocks_needed: int
    free_blocks: int
    max_contiguous_free: int
    tokens: int
    """preempt: computed tokens lost; resume: tokens to recompute (-1 unknown: preempted
    before the sidecar took the engine up); finish: output tokens."""
    policy: str
    msg: str
    """Stable human line, e.g. 'Preempting request r1 due to kv_full free_blocks=0
    max_contiguous=0 blocks_needed=1'."""
    server: str = ""
    """The engine's vLLM server (kvscope_probe.identity); "" outside an API server."""


@dataclass(frozen=True, slots=True)
class StepStat:
    """Per-second rollup of budget vs blocks for one engine (table ``step_stats``)."""

    ts: float
    """Start of the second (engine clock)."""
    model: str
    engine: str
    steps: int
    scheduled_tokens: int
    budget_tokens: int
    min_free_blocks: int
    avg_free_blocks: float
    min_max_contiguous_free: int
    """-1 when not sampled in that second."""
    max_used_blocks: int
    avg_running: float
    max_waiting: int
    preemptions: int
    tail_waste_tokens: int
    """When the second's rollup was written (-1 while the ledger is stale)."""
    server: str = ""
    """The engine's vLLM server (kvscope_probe.identity); "" outside an API server."""


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One row per API request the middleware saw answered (table ``client_requests``)."""

    ts: float
    """When the HTTP answer was sent (API-server clock)."""
    request_id: str
    """The request's ID as vLLM used it (the caller's X-Request-Id or body request_id, else
    the middleware's); ``sha256:<hex>`` of it when longer than 128 characters or not
    encodable in UTF-8 (``kvscope_probe.middleware.request_key``)."""
    engine_request_ids: str
    """Engine request IDs joined to it, comma-separated ("" if none joined yet): kept for
    readers older than ``engine_ids``, ambiguous when an ID holds a comma."""
    model: str
    endpoint: str
    client_id: str
    user_agent: str
    api_key_hash: str
    prompt_hash: str
    prompt_chars: int
    max_tokens: int
    http_status: int
    duration_s: float
    duplicate: bool
    """Same client and prompt hash seen within the duplicate window before."""
    duplicate_of: str
    preempt_count: int
    """Preemptions of its engine requests (-1 when none joined)."""
    preempt_reason: str
    engine_ids: list[str]
    """Engine request IDs joined to it, each exactly as vLLM named it (empty if none joined
    yet, and in rows written before the column: ``engine_request_ids`` holds them then)."""


@dataclass(frozen=True, slots=True)
class LayoutSnapshotRow:
    """One sample of an engine's block pool (table ``layout_snapshots``); the per-block
    arrays are described in clickhouse/schema/050_layout_snapshots.sql."""

    ts: float
    model: str
    engine: str
    session: str
    step: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    max_contiguous_free: int
    budget_utilization: float
    running: int
    waiting: int
    kv_group_kinds: list[str]
    states: list[int]
    block_group: list[int]
    owner: list[int]
    owner_req_ids: list[str]
    owner_blocks: list[int]
    owner_fragments: list[int]
    owner_group_runs: list[list[list[int]]]
    server: str = ""
    """The engine's vLLM server (kvscope_probe.identity); "" outside an API server."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """A row per probe session: the engine's settings as its hello states them (table
    ``engine_configs``), so a replay of its traffic can be rebuilt from the store alone
    (``kvscope explain --counterfactual``); written again every hour of engine time
    (``requests.CONFIG_EVERY_S``), so the store's TTL never leaves a running engine
    without one."""

    ts: float
    """When the probe attached (the hello's time), or when the row was written again."""
    model: str
    engine: str
    session: str
    vllm_version: str
    num_blocks: int
    """Blocks in the pool, the null block included."""
    block_size: int
    kv_group_kinds: list[str]
    """Each KV cache group's spec class (``FullAttentionSpec``, ``SlidingWindowSpec``, ...)."""
    kv_group_block_sizes: list[int]
    kv_group_windows: list[int]
    """Each group's sliding window in tokens (0 for other kinds)."""
    token_budget: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    """0 when the probe did not say (a probe before this field)."""
    policy: str
    prefix_caching: bool
    async_scheduling: bool
    spec_tokens: int
    server: str = ""
    """The engine's vLLM server (kvscope_probe.identity); "" outside an API server."""
    watermark_blocks: int = 0
    """Blocks ``--watermark`` keeps from waiting and preempted requests while any request
    runs (vLLM's ``KVCacheManager.watermark_blocks``); 0: none, or a probe before it."""


TABLES: dict[str, type] = {
    "request_traces": RequestTrace,
    "request_events": RequestEvent,
    "request_allocations": RequestAllocations,
    "scheduler_decisions": SchedulerDecision,
    "step_stats": StepStat,
    "client_requests": ClientRequest,
    "layout_snapshots": LayoutSnapshotRow,
    "engine_configs": EngineConfig,
}


def _slot_init(cls: type) -> None:
    """Gives a frozen slots dataclass an ``__init__`` that sets each slot through its
    descriptor. The one ``dataclass`` writes for a frozen class calls
    ``object.__setattr__`` by name for every field: 3.0 µs a ``RequestTrace`` against 1.7
    (the ingest thread builds ~2.5 rows a step at 256 running). Same parameters, same
    defaults; the rows stay frozen (assigning to one raises FrozenInstanceError)."""
    fs = fields(cls)
    ns: dict[str, Any] = {}
    params = []
    for f in fs:
        ns[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        if f.default is MISSING:
            params.append(f.name)
        else:
            ns[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    body = "".join(f"    _set_{f.name}(self, {f.name})\n" for f in fs)
    exec(f"def __init__(self, {', '.join(params)}):\n{body}", ns)  # noqa: S102 - our names only
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[misc]


for _cls in TABLES.values():
    _slot_init(_cls)
del _cls


def columns(table: str) -> list[str]:
    return [f.name for f in fields(TABLES[table])]


def as_tuple(row: Any) -> tuple[Any, ...]:
    return tuple(getattr(row, f) for f in row.__slots__)


def table_of(row: Any) -> str:
    return _TABLE_BY_TYPE[type(row)]


_TABLE_BY_TYPE = {v: k for k, v in TABLES.items()}
