"""The engine thread's whole share of the probe, replayed call by call, beside a floor.

``CallLog`` sits on a live twin's pool while probe_micro.py records its window: every
call of a wrapped pool method (arguments materialised, result kept) and every block
allocation the blocks-needed hook saw while armed. The replay then calls, per step, the
probe's real wrappers (``hooks``) around stand-ins for vLLM's methods that do nothing,
then its real ``schedule()`` wrapper around a stand-in returning the step's recorded
``SchedulerOutput`` (which runs ``Recorder.on_step``), minus the same calls with no
wrapper: the probe's engine-thread time, vLLM's own work excluded.

The floor replays the same calls through the least any probe could do and still keep
the sidecar's ledger exact: a call layer that keeps a reference to each pool call's
blocks, and after ``schedule()`` C-level copies of what the ledger reads from the
output (scheduled tokens, scheduled-again IDs and computed counts, new block lists, new
requests' tables, finished and preempted IDs) plus each touched block's ID, reference
count and hash read back (its state after the step). It leaves out, by design: the order
of block operations inside a step (the ledger's state at a preemption), preemption and
arrival facts, the blocks-needed hook, the free-count self-check, sliding-window nulling
and other pools' blocks; and the collector's work on the containers it allocates (which
encoding to bytes avoids).
"""

from __future__ import annotations

import time
from itertools import chain
from operator import attrgetter
from typing import Any

_now = time.perf_counter_ns
POOL_METHODS = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks", "evict_blocks")
_state = attrgetter("block_id", "ref_cnt", "block_hash")


class CallLog:
    """Installed on a live Recorder's pool and manager (instance attributes shadow the
    probe's class-level wrappers, which still run inside)."""

    def __init__(self, rec: Any) -> None:
        self.calls: list[tuple[str, Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self.armed = 0
        pool = rec.pool
        for name in POOL_METHODS:
            bound = getattr(pool, name, None)
            if bound is not None:
                pool.__dict__[name] = self._logging(name, bound)
        o_alloc = rec.mgr.allocate_slots

        def allocate_slots(*args: Any, **kwargs: Any) -> Any:
            self.armed += rec.need_armed
            return o_alloc(*args, **kwargs)

        rec.mgr.allocate_slots = allocate_slots

    def _logging(self, name: str, bound: Any) -> Any:
        calls = self.calls
        materialise = name != "get_new_blocks"  # an iterator is read once

        def call(arg: Any, *rest: Any, **kwargs: Any) -> Any:
            if materialise:
                arg = list(arg)
            ret = bound(arg, *rest, **kwargs)
            calls.append((name, arg, rest, kwargs, ret))
            return ret

        return call

    def take(self) -> tuple[list[Any], int]:
        """The calls since the last take, and the armed allocations among them."""
        calls, armed = self.calls[:], self.armed
        self.calls.clear()
        self.armed = 0
        return calls, armed


class RawPool:
    """vLLM's pool methods doing nothing: the replay times only what wraps them."""

    ret: Any = None

    def get_new_blocks(self, num_blocks: int) -> Any:
        return self.ret

    def touch(self, blocks: Any) -> None:
        return None

    def free_blocks(self, ordered_blocks: Any) -> None:
        return None

    def unpin_blocks(self, blocks: Any, on_reuse: Any = None) -> None:
        return None

    def evict_blocks(self, block_ids: Any) -> None:
        return None

    def reset_prefix_cache(self) -> bool:
        return True


class RawSched:
    out: Any = None

    def schedule(self) -> Any:
        return self.out

    def _preempt_request(self, request: Any, timestamp: float = 0.0) -> None:
        return None


def floor_copy(out: Any) -> tuple[Any, ...]:
    """What the ledger reads from one ``SchedulerOutput``, copied (no encoding)."""
    c = out.scheduled_cached_reqs
    nb = c.new_block_ids
    return (out.num_scheduled_tokens.copy(), list(c.req_ids), list(c.num_computed_tokens),
            nb.copy(), [list(map(list, b)) for b in filter(None, nb)],
            [(r.req_id, list(map(list, r.block_ids)), r.num_computed_tokens)
             for r in out.scheduled_new_reqs],
            list(out.finished_req_ids), list(out.preempted_req_ids), list(c.resumed_req_ids))


def floor_classes() -> tuple[Any, Any]:
    """Pool and scheduler stand-ins wrapped by the floor probe."""
    touched: list[Any] = []
    ring: list[Any] = []

    class FloorPool(RawPool):
        def get_new_blocks(self, num_blocks: int) -> Any:
            ret = RawPool.get_new_blocks(self, num_blocks)
            touched.append(ret)
            return ret

        def evict_blocks(self, block_ids: Any) -> None:
            block_ids = list(block_ids)
            RawPool.evict_blocks(self, block_ids)
            ring.append(block_ids)

    def blocks_in(orig: Any) -> Any:
        def wrapper(self: Any, blocks: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = list(blocks)
            ret = orig(self, blocks, *args, **kwargs)
            touched.append(blocks)
            return ret
        return wrapper

    for name in ("touch", "free_blocks", "unpin_blocks"):
        setattr(FloorPool, name, blocks_in(getattr(RawPool, name)))

    class FloorSched(RawSched):
        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            out = RawSched.schedule(self, *args, **kwargs)
            ring.append((floor_copy(out), list(map(_state, chain.from_iterable(touched)))))
            touched.clear()
            return out

    FloorSched.ring = ring  # type: ignore[attr-defined]
    return FloorPool, FloorSched


def probe_classes(rec: Any) -> tuple[Any, Any]:
    """Pool and scheduler stand-ins wrapped by the probe's own hooks, bound to ``rec``."""
    from kvscope_probe import hooks

    class ProbePool(RawPool):
        pass

    class ProbeSched(RawSched):
        pass

    hooks._pool_hooks(ProbePool)
    hooks._scheduler_hooks(ProbeSched, lambda _s: None)
    ProbePool._kvscope = rec
    ProbeSched._kvscope = rec
    return ProbePool, ProbeSched


COLD_KEYS = [f"req-{i:06d}" for i in range(4_000)]


def cool() -> None:
    """Unrelated Python work between steps, as vLLM's scheduling is in place: it pushes
    the probe's code and data out of the core's first caches (a dict of 4,000 string
    keys built and sorted, ~1 ms)."""
    sorted(dict.fromkeys(COLD_KEYS, 0).items(), key=lambda kv: kv[0][::-1])


def _replay(pool: Any, sched: Any, steps: list[tuple[Any, list[Any]]], reps: int,
            after: Any, before: Any = None) -> list[float]:
    """Per step, the fastest replay of its pool calls then ``schedule()``, in ns;
    ``before`` runs before each step, untimed."""
    bound = [(out, [(getattr(pool, n), a, r, k, ret) for n, a, r, k, ret in calls])
             for out, calls in steps]
    best = [float("inf")] * len(steps)
    for _ in range(reps):
        for i, (out, calls) in enumerate(bound):
            sched.out = out
            if before is not None:
                before()
            t0 = _now()
            for meth, arg, rest, kwargs, ret in calls:
                pool.ret = ret
                meth(arg, *rest, **kwargs)
            sched.schedule()
            dt = _now() - t0
            after()
            best[i] = min(best[i], dt)
    return best


def need_hook_ns(rec: Any, reps: int) -> float:
    """The armed blocks-needed hook's cost per call over vLLM's own method, called as
    vLLM's scheduler calls it, for a running request (no block to allocate)."""
    coord = rec.mgr.coordinator
    armed = rec.need_armed
    rec.watch_need(0)  # armed now, whatever the pool holds
    hook = coord.__dict__["get_num_blocks_to_allocate"]
    raw = type(coord).get_num_blocks_to_allocate
    req = next(iter(rec.sched.running))
    kwargs = dict(request_id=req.request_id, num_tokens=req.num_computed_tokens,
                  new_computed_blocks=rec.mgr.empty_kv_cache_blocks.blocks,
                  num_encoder_tokens=0, total_computed_tokens=req.num_computed_tokens,
                  num_local_computed_tokens=req.num_computed_tokens,
                  num_tokens_main_model=req.num_computed_tokens,
                  prefill_end=req.num_prompt_tokens)

    def per_call(fn: Any, *head: Any) -> float:
        t0 = _now()
        for _ in range(200):
            fn(*head, **kwargs)
        return (_now() - t0) / 200

    try:
        return (min(per_call(hook) for _ in range(reps))
                - min(per_call(raw, coord) for _ in range(reps)))
    finally:
        if not armed:
            rec.watch_need(1 << 62)
        rec.need = None


def engine_and_floor(rec: Any, steps: list[tuple[Any, list[Any]]], armed: list[int],
                     reps: int, cold: bool = False) -> dict[str, list[float]]:
    """Per step (µs): the probe's engine-thread time (its wrappers, the need hook while
    armed, ``schedule()``'s wrapper and record), the same with its records kept as
    structs instead of encoded (``unencoded``: what encoding costs is the difference; a
    probe cannot keep them so, they hold vLLM's lists) and the floor's, each the fastest
    replay minus the fastest bare replay of the same calls. ``cold``: ``cool()`` before
    every step of every replay (bare ones too)."""
    rec.next_keyframe_ns = 1 << 62

    def reset() -> None:
        rec.take_ops()
        rec.ring.clear()
        rec.popped_bytes = rec.pushed_bytes
        rec.want_keyframe = False

    def unencoded(item: Any) -> None:
        rec.ring.append((0, item))

    p_pool, p_sched = probe_classes(rec)
    f_pool, f_sched = floor_classes()
    before = cool if cold else None
    bare = _replay(RawPool(), RawSched(), steps, reps, lambda: None, before)
    probe = _replay(p_pool(), p_sched(), steps, reps, reset, before)
    rec.push = unencoded  # type: ignore[method-assign]
    try:
        plain = _replay(p_pool(), p_sched(), steps, reps, reset, before)
    finally:
        del rec.push
    floor = _replay(f_pool(), f_sched(), steps, reps, f_sched.ring.clear, before)
    hook = need_hook_ns(rec, max(reps, 10))
    return {
        "engine": [(p - b + a * hook) / 1e3 for p, b, a in zip(probe, bare, armed, strict=True)],
        "unencoded": [(p - b + a * hook) / 1e3
                      for p, b, a in zip(plain, bare, armed, strict=True)],
        "floor": [(f - b) / 1e3 for f, b in zip(floor, bare, strict=True)],
        "need_hook_ns": [hook],
    }


def send_floor_us(frame_bytes: list[list[bytes]], reps: int) -> float:
    """The least a sender can do per frame: wake from a sleep once and make one ZMQ
    send of the encoded frame; the sending thread's CPU (an in-process PULL drains it;
    libzmq's I/O thread is not counted, nor a wait for the GIL), fastest of ``reps``
    passes, per frame in µs."""
    import threading

    import zmq

    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    n = len(frame_bytes) * reps
    drained = threading.Thread(target=lambda: [pull.recv_multipart() for _ in range(n)])
    drained.start()
    best = float("inf")
    try:
        for _ in range(reps):
            t0 = time.thread_time_ns()
            for parts in frame_bytes:
                time.sleep(0.001)
                push.send_multipart(parts, copy=False)
            best = min(best, (time.thread_time_ns() - t0) / 1e3 / len(frame_bytes))
        drained.join(30)
    finally:
        push.close(0)
        pull.close(0)
    return best


# -- the floor in place: installed on vLLM's own classes (probe_interleaved.py --floor) ---
class FloorRecorder:
    """What the floor hooks below need of a recorder: the ring (encoded records, emptied
    by the harness), the blocks the step's pool calls touched, the evicted IDs."""

    def __init__(self, sched: Any) -> None:
        self.pool = sched.kv_cache_manager.block_pool
        self.enabled = True
        self.ring: list[tuple[int, bytes]] = []
        self.seq = self.pushed_bytes = self.popped_bytes = self.faults = 0
        self.touched: list[Any] = []
        self.evicted: list[int] = []

    def watch_need(self, _free_blocks: int) -> None:
        """The floor has no blocks-needed hook."""


def install_floor() -> None:
    """Wrap vLLM's BlockPool and Scheduler with the floor's hooks, the in-place twin of
    ``floor_classes``: a layer per pool call keeping its blocks, and after ``schedule()``
    what the ledger reads, encoded at once (msgpack straight from vLLM's lists, as the
    probe encodes, so no container outlives the step) with each touched block's ID,
    reference count and hash. Once per process, instead of the probe's hooks."""
    import msgspec
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler

    encode = msgspec.msgpack.Encoder().encode
    o_new, o_evict = BlockPool.get_new_blocks, BlockPool.evict_blocks

    def get_new_blocks(self: Any, num_blocks: int, *args: Any, **kwargs: Any) -> Any:
        ret = o_new(self, num_blocks, *args, **kwargs)
        rec = self._kvscope
        if rec is not None and rec.enabled:
            rec.touched.append(ret)
        return ret

    def blocks_in(orig: Any) -> Any:
        def wrapper(self: Any, blocks: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self._kvscope
            if rec is None or not rec.enabled:
                return orig(self, blocks, *args, **kwargs)
            blocks = list(blocks)
            ret = orig(self, blocks, *args, **kwargs)
            rec.touched.append(blocks)
            return ret
        return wrapper

    def evict_blocks(self: Any, block_ids: Any) -> Any:
        rec = self._kvscope
        if rec is None or not rec.enabled:
            return o_evict(self, block_ids)
        block_ids = list(block_ids)
        ret = o_evict(self, block_ids)
        rec.evicted.extend(block_ids)
        return ret

    BlockPool.get_new_blocks, BlockPool.evict_blocks = get_new_blocks, evict_blocks
    for name in ("touch", "free_blocks", "unpin_blocks"):
        setattr(BlockPool, name, blocks_in(getattr(BlockPool, name)))
    BlockPool._kvscope = None
    o_schedule = Scheduler.schedule

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self._kvscope
        if rec is None or not rec.enabled:
            return o_schedule(self, *args, **kwargs)
        out = o_schedule(self, *args, **kwargs)
        c = out.scheduled_cached_reqs
        touched = rec.touched
        data = encode((out.num_scheduled_tokens, c.req_ids, c.num_computed_tokens,
                       c.new_block_ids, [(r.req_id, r.block_ids, r.num_computed_tokens)
                                         for r in out.scheduled_new_reqs],
                       out.finished_req_ids, out.preempted_req_ids, c.resumed_req_ids,
                       list(map(_state, chain.from_iterable(touched))), rec.evicted))
        touched.clear()
        rec.evicted = []
        rec.seq += 1
        rec.pushed_bytes += len(data)
        rec.ring.append((rec.seq, data))
        return out

    Scheduler.schedule = schedule
    Scheduler._kvscope = None
