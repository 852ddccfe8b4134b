"""At attach the probe checks the vLLM classes it hooks against its fingerprint: on the
fingerprinted versions nothing is off; a doctored class switches off exactly the feature
that reads it, in one log line, and vLLM's schedule is unchanged."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import fingerprint as fp
from kvscope_probe import hooks, plugin
from kvscope_probe.recorder import Recorder
from tests.twin.exactness import step_trail

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager  # noqa: E402


def test_the_installed_vllm_matches_the_fingerprint() -> None:
    import vllm

    assert ".".join(vllm.__version__.split(".")[:2]) in fp.KNOWN
    assert fp.check() == {}


def _renamed(cls: type, attr: str, old: str, new: str) -> type:
    """A subclass of vLLM's ``cls`` whose ``attr`` calls vLLM's with parameter ``old``
    renamed ``new``."""
    orig = getattr(cls, attr)
    sig = inspect.signature(orig)
    params = [p.replace(name=new) if p.name == old else p for p in sig.parameters.values()]

    def method(self: Any, *a: Any, **k: Any) -> Any:
        if new in k:
            k[old] = k.pop(new)
        return orig(self, *a, **k)

    method.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return type(cls.__name__, (cls,), {attr: method})


def _manager_copy(without: str) -> type:
    """A copy of vLLM's base manager lacking ``without``, with a copy of every real
    ``_relocate_speculative_block`` override below it."""
    base = type("SingleTypeKVCacheManager", (),
                {k: v for k, v in SingleTypeKVCacheManager.__dict__.items()
                 if k != without and not k.startswith("__")})
    todo, kept = [SingleTypeKVCacheManager], []
    while todo:
        sub = todo.pop()
        todo += sub.__subclasses__()
        if without != "_relocate_speculative_block" and \
                "_relocate_speculative_block" in sub.__dict__:
            kept.append(type(sub.__name__, (base,), {
                "_relocate_speculative_block": sub.__dict__["_relocate_speculative_block"]}))
    base._copies = kept  # type: ignore[attr-defined]  # __subclasses__ holds them weakly
    return base


@dataclasses.dataclass(slots=True)
class _MovedHash(KVCacheBlock):
    """vLLM's block whose ``block_hash`` property reads another field."""

    _hash: Any = None

    @property  # type: ignore[misc]
    def block_hash(self) -> Any:
        return self._hash


DOCTORED: dict[str, tuple[str, Any]] = {
    "renamed touch parameter": ("core", {fp.POOL: _renamed(BlockPool, "touch", "blocks", "bs")}),
    "renamed evict parameter": ("uncache", {fp.POOL: _renamed(
        BlockPool, "evict_blocks", "block_ids", "ids")}),
    "renamed add_request parameter": ("arrivals", {fp.SCHED: _renamed(
        Scheduler, "add_request", "request", "req")}),
    "renamed _free_request parameter": ("ends", {fp.SCHED: _renamed(
        Scheduler, "_free_request", "request", "req")}),
    "renamed blocks-needed parameter": ("need", {fp.COORD: _renamed(
        KVCacheCoordinator, "get_num_blocks_to_allocate", "request_id", "rid")}),
    "missing _remove_blocks_in_range": ("null_tables", {
        fp.MANAGER: _manager_copy("_remove_blocks_in_range")}),
    "missing _relocate_speculative_block": ("relocate", {
        fp.MANAGER: _manager_copy("_relocate_speculative_block")}),
    "block_hash over another field": ("hash_field", {fp.BLOCK: _MovedHash}),
}


@pytest.mark.parametrize("case", list(DOCTORED))
def test_a_doctored_class_switches_off_exactly_its_feature(case: str) -> None:
    feature, classes = DOCTORED[case]
    off = fp.check(classes)
    assert list(off) == [feature], off
    line = fp.line(off, "0.32.0")
    assert "\n" not in line and feature in line and off[feature] in line


def test_a_missing_kv_holding_waiting_switches_off_only_that() -> None:
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    assert fp.instance(twin.scheduler) == {}
    del twin.scheduler.kv_holding_waiting
    assert fp.instance(twin.scheduler) == {"kv_holding": "Scheduler has no kv_holding_waiting"}


def _run(rec_factory: Any = None, hide: str | None = None) -> tuple[Any, Any, list[Any]]:
    """One twin run; ``hide``: a scheduler attribute absent while the Recorder attaches
    (put back for the run: vLLM's own steps read it)."""
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    rec = None
    if rec_factory is not None:
        hidden = twin.scheduler.__dict__.pop(hide) if hide else None
        rec = rec_factory(twin.scheduler)
        if hide:
            setattr(twin.scheduler, hide, hidden)
        plugin.bind(twin.scheduler, rec)
    trail, on_step = step_trail(twin)
    result = twin.run(generate(WorkloadSpec(n_requests=40, seed=3)), on_step=on_step)
    return result, rec, trail


@pytest.mark.parametrize("feature", ["need", "hash_field", "kv_holding"])
def test_a_switched_off_feature_leaves_the_schedule_unchanged(
        feature: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Recorder carries what is off and acts on it; vLLM runs step for step as
    unprobed."""
    _, _, base = _run()
    if feature != "kv_holding":
        monkeypatch.setitem(hooks.DISABLED, feature, "doctored")
    result, rec, trail = _run(
        lambda s: Recorder(s, ring_size=1 << 20, keyframe_interval_s=3600),
        hide="kv_holding_waiting" if feature == "kv_holding" else None)
    assert trail == base
    assert list(rec.disabled) == [feature] and rec.enabled and rec.faults == 0
    assert rec.hello.disabled == rec.disabled  # what the sidecar is told
    if feature == "need":
        assert rec.arm_below == -1 and not rec.need_armed
    if feature == "kv_holding":
        assert rec.kv_holding is None
    if feature == "hash_field":
        assert rec.sort_freed.__name__ == "_sort_freed"


def test_a_doctored_vllm_leaves_that_hook_out_with_one_log_line(tmp_path: object) -> None:
    """vLLM's ``evict_blocks`` with a renamed parameter: the probe installs every other
    hook and leaves that one as vLLM's, saying why in one line."""
    code = textwrap.dedent(f"""
        import inspect, logging, os
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        os.environ["KVSCOPE_PROBE_ENDPOINT"] = "ipc://{tmp_path}/p.sock"
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.sched.scheduler import Scheduler
        real = BlockPool.evict_blocks
        def evict_blocks(self, ids): return real(self, ids)
        BlockPool.evict_blocks = evict_blocks
        touch, schedule = BlockPool.touch, Scheduler.schedule
        from kvscope_probe import hooks, plugin
        plugin.register()
        print("EVICT", BlockPool.evict_blocks is evict_blocks)
        print("OTHERS", BlockPool.touch is not touch and Scheduler.schedule is not schedule)
        print("DISABLED", sorted(hooks.DISABLED))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={"VLLM_LOGGING_LEVEL": "ERROR", "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EVICT True" in out.stdout and "OTHERS True" in out.stdout, out.stdout
    assert "DISABLED ['uncache']" in out.stdout
    lines = [ln for ln in out.stderr.splitlines()
             if ln.startswith("kvscope_probe") and "not recording" in ln]
    assert len(lines) == 1 and "uncache" in lines[0] and "parameter 1 is ids" in lines[0], \
        out.stderr[-2000:]


def test_a_manager_with_a_pool_of_its_own_keeps_the_probe_out() -> None:
    """vLLM 0.33's HiSparse gives a KV cache manager a host pool of its own
    (``bind_host_pool``) and releases resident pages while they stay in the request's
    table (``residency_changes``): block IDs of another pool, or blocks the pool counts
    free, read as the request's own. The probe's mirror would not be vLLM's pool, and its
    audit reads the same tables: it keeps out, saying why, rather than report them."""
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    (mgr,) = twin.scheduler.kv_cache_manager.coordinator.single_type_managers
    own = mgr.block_pool
    mgr.block_pool = object()
    off = fp.instance(twin.scheduler)
    assert list(off) == ["core"] and "FullAttentionManager" in off["core"]
    mgr.block_pool = own
    mgr.residency_changes = {}
    off = fp.instance(twin.scheduler)
    assert list(off) == ["core"] and "residency_changes" in off["core"]
    del mgr.residency_changes
    assert fp.instance(twin.scheduler) == {}
