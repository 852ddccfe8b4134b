"""The ways issue 23 found kvscope's code raising into vLLM, each reproduced.

Each test calls a hooked vLLM entry point the way vLLM (or its next version) may: with
keywords, with a new parameter, with a private attribute missing. vLLM's method must
run and its result come back; kvscope's failure must be counted, never raised.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvscope.twin import TwinConfig
from kvscope_probe import hooks, plugin
from kvscope_probe.manager_hooks import manager_hooks
from kvscope_probe.needhook import need_hook
from kvscope_probe.recorder import Recorder

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin


class Rec(SimpleNamespace):
    """Counts faults as Recorder.fault does."""

    def __init__(self) -> None:
        super().__init__(enabled=True, faults=0, wrap_ns=0, ops=[], allocs=0, need=None,
                         null_ctx=None, freed=[])

    def fault(self, where: str, exc: BaseException) -> None:
        self.faults += 1

    def on_free(self, blocks: Any) -> None:
        self.freed.append(list(blocks))

    def on_alloc(self, blocks: Any) -> None:
        self.ops.append(list(blocks))


def test_need_hook_called_with_keywords_only_on_another_first_name() -> None:
    """vLLM passes keywords only; a method whose first parameter is not request_id
    gets the generic hook, which read args[0]: an IndexError inside allocate_slots."""

    class Coord:
        def get_num_blocks_to_allocate(self, req_id: str, *args: Any, **kw: Any) -> int:
            return 7

    rec = Rec()
    hook = need_hook(Coord.get_num_blocks_to_allocate, Coord(), rec)
    assert hook(req_id="a", num_tokens=3) == 7


def _pool_class() -> type:
    class Block(SimpleNamespace):
        pass

    class Pool:
        """A BlockPool of a later vLLM: new parameters, called by keyword."""

        def __init__(self) -> None:
            self.blocks = [Block(block_id=i, ref_cnt=0, is_null=False) for i in range(4)]

        def get_new_blocks(self, num_blocks: int) -> list[Any]:
            return self.blocks[:num_blocks]

        def touch(self, blocks: Any, *, tier: int = 0) -> str:
            return f"touched {len(blocks)} tier {tier}"

        def free_blocks(self, ordered_blocks: Any) -> str:
            return f"freed {len(list(ordered_blocks))}"

        def unpin_blocks(self, blocks: Any, on_reuse: Any = None) -> str:
            return "unpinned"

        def get_num_free_blocks(self) -> int:
            return 4

    hooks._pool_hooks(Pool, registry={})
    return Pool


def test_touch_with_a_new_parameter_is_not_a_type_error() -> None:
    pool = _pool_class()()
    pool._kvscope = rec = Rec()
    assert pool.touch(pool.blocks[:2], tier=1) == "touched 2 tier 1"
    assert rec.ops == [pool.blocks[:2]] and rec.faults == 0


def test_free_blocks_by_keyword_is_recorded_not_a_type_error() -> None:
    pool = _pool_class()()
    pool._kvscope = rec = Rec()
    assert pool.free_blocks(ordered_blocks=iter(pool.blocks[:3])) == "freed 3"
    assert rec.freed == [pool.blocks[:3]] and rec.faults == 0


def _sched_class() -> type:
    class Sched:
        def __init__(self) -> None:
            self.requests: dict[str, Any] = {}
            self.table: dict[str, Any] = {}

        def schedule(self) -> str:
            return "out"

        def _preempt_request(self, request: Any, timestamp: float) -> None: ...

        def add_request(self, request: Any, *, streaming: bool = False) -> str:
            self.table[request.request_id] = request
            return f"added streaming={streaming}"

    return Sched


def test_add_request_with_a_new_parameter_and_no_requests_table() -> None:
    """add_request had a fixed arity and read self.requests before vLLM's method ran."""
    cls = _sched_class()
    hooks._scheduler_hooks(cls, lambda sched: None)
    sched = cls()
    assert sched.add_request(SimpleNamespace(request_id="a"), streaming=True) == (
        "added streaming=True")
    del sched.requests  # a vLLM that keeps its table elsewhere
    sched._kvscope = rec = Rec()
    assert sched.add_request(request=SimpleNamespace(request_id="b")) == "added streaming=False"
    assert rec.faults == 1


def test_preempt_by_keyword_reaches_vllm() -> None:
    cls = _sched_class()
    hooks._scheduler_hooks(cls, lambda sched: None)
    sched = cls()
    sched._kvscope = rec = Rec()
    rec.on_preempt = lambda req: None
    assert sched._preempt_request(request=SimpleNamespace(), timestamp=0.0) is None
    assert rec.faults == 0


def test_sliding_window_hook_without_block_pool_or_group_id() -> None:
    class Manager:
        def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> str:
            return f"nulled {first}-{last}"

    manager_hooks(Manager)
    m = Manager()  # no block_pool, no kv_cache_group_id
    assert m._remove_blocks_in_range("r", 0, 2) == "nulled 0-2"
    m.block_pool = SimpleNamespace(_kvscope=Rec())  # a pool, still no group ID
    assert m._remove_blocks_in_range(request_id="r", first=1, last=3) == "nulled 1-3"
    assert m.block_pool._kvscope.faults == 1


@pytest.fixture
def endpoint(tmp_path: Any) -> Any:
    old = plugin._endpoint
    assert plugin.enable(f"ipc://{tmp_path}/nobody.sock")
    yield
    plugin.stop_all()
    plugin.enable(None)
    plugin._endpoint = old


def test_a_failing_bind_leaves_no_half_bound_recorder_and_no_sender(
        endpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """bind() ran outside attach's try: a failure left the scheduler pointing at a
    Recorder (and a sender thread running) that nothing had finished setting up."""

    def fails(self: Any, free: int) -> None:
        raise RuntimeError("bind fails")

    monkeypatch.setattr(Recorder, "watch_need", fails)
    before = set(threading.enumerate())
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    assert not getattr(twin.scheduler._kvscope, "enabled", False)
    assert plugin._senders == []
    twin.scheduler.schedule()
    # The sender started before bind failed is told to stop: it ends (within its connect
    # grace and flush deadline), so no later test shares the probe's ZMQ context with it.
    started = [t for t in threading.enumerate() if t not in before]
    assert [t.name for t in started] in ([], ["kvscope-probe-sender"])
    for t in started:
        t.join(30)
        assert not t.is_alive()


def test_attach_failing_from_schedule_and_add_request_is_contained(
        endpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """attach was reached unguarded from schedule() and add_request()."""

    class Broken:
        def __enter__(self) -> None:
            raise RuntimeError("attach fails")

        def __exit__(self, *a: Any) -> None: ...

    monkeypatch.setattr(plugin, "_lock", Broken())
    from kvscope.twin import WorkloadSpec, generate

    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    result = twin.run(generate(WorkloadSpec(n_requests=5, seed=1)))
    assert result.finished == 5


class VLLMFailed(RuntimeError):
    pass


def _failing_sched(method: str) -> tuple[type, Any, Rec]:
    """A hooked scheduler class whose ``method`` raises vLLM's own error, an instance
    and the Recorder bound to it."""
    cls = _sched_class()

    def fails(self: Any) -> None:
        raise VLLMFailed(f"vLLM's {method} failed")

    setattr(cls, method, fails)
    hooks._scheduler_hooks(cls, lambda sched: None)
    sched = cls()
    sched._kvscope = rec = Rec()
    return cls, sched, rec


def test_a_schedule_that_raises_leaves_the_recorder_outside_schedule() -> None:
    """The hook set ``in_schedule`` before vLLM's schedule() and cleared it after; when
    vLLM's method raised (and the engine survived it), every later preemption was
    classified as if inside a schedule, against a blocks-needed figure from a step that
    never finished."""
    cls, sched, rec = _failing_sched("schedule")
    rec.in_schedule = False
    with pytest.raises(VLLMFailed):
        sched.schedule()
    assert rec.in_schedule is False and rec.faults == 0
    # An undo that fails itself is counted; vLLM's own error is the one raised.
    hook = cls.schedule._kvscope_hook
    hook.undo = lambda *a: 1 / 0
    with pytest.raises(VLLMFailed):
        sched.schedule()
    assert rec.faults == 1


def test_a_window_removal_that_raises_does_not_name_later_frees_nulled() -> None:
    """The hook marked which table ``_remove_blocks_in_range``'s frees null and restored
    the mark after; when vLLM's method raised, the mark stayed, and every block the
    engine freed afterwards (a request finishing) was reported nulled in that table."""
    pool_cls = _pool_class()

    class Manager:
        kv_cache_group_id = 1

        def __init__(self, pool: Any) -> None:
            self.block_pool = pool

        def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
            self.block_pool.free_blocks(self.block_pool.blocks[first:last])
            raise VLLMFailed("vLLM's own error")

    manager_hooks(Manager)
    pool = pool_cls()
    pool._kvscope = rec = Rec()
    rec.nulled = []
    rec.on_free = lambda blocks: rec.nulled.append((rec.null_ctx, len(list(blocks))))
    with pytest.raises(VLLMFailed):
        Manager(pool)._remove_blocks_in_range("r", 0, 2)
    pool.free_blocks(pool.blocks[2:3])  # a request ending, outside any window removal
    assert rec.nulled == [(("r", 1), 2), (None, 1)]
    assert rec.null_ctx is None and rec.faults == 0


def test_a_shutdown_that_raises_still_ends_the_sender() -> None:
    """vLLM's Scheduler.shutdown ends the sender through the hook's after part; when
    vLLM's method raised (a KV connector's or event publisher's shutdown failing), the
    Recorder kept recording and its sender sent heartbeats for a dead scheduler forever
    (the sidecar read the engine idle, not gone). It ends as vLLM's shutdown begins."""
    _cls, sched, rec = _failing_sched("shutdown")
    closed: list[bool] = []
    rec.close = lambda: closed.append(True)
    with pytest.raises(VLLMFailed):
        sched.shutdown()
    assert closed == [True] and rec.faults == 0
