"""Families from outside the probe: vLLM's own /metrics (an engine seen only through it,
and the reconciliation of a probed engine against it) and the GPUs (NVML)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from kvscope.sidecar.exposition.gpu import GpuReader
from kvscope.sidecar.exposition.metric_families import EL, Families
from kvscope.sidecar.exposition.vllm_metrics import VllmScraper
from kvscope.state.engine import EngineState
from kvscope.state.hub import Hub


def vllm_families(f: Families, hub: Hub, sc: VllmScraper) -> None:
    """Scrape counts; per engine at --vllm-url, coarse figures or the reconciliation."""
    f.c("kvscope_vllm_scrapes", []).add_metric([], sc.scrapes)
    f.c("kvscope_vllm_scrape_errors", []).add_metric([], sc.errors)
    for vm in sc.latest.values():
        with hub.lock:
            st = _probed(hub, sc, vm.engine)
            if st is not None:
                _reconcile(f, st, vm)
                continue
        _coarse(f, sc, vm)


def _probed(hub: Hub, sc: VllmScraper, engine: str) -> EngineState | None:
    """The probed engine that vLLM's ``engine`` label at --vllm-url means: the only one
    with that label, or the only one whose server has the URL's port."""
    same = [s for s in hub.engines.values() if s.engine == engine]
    if len(same) > 1:
        port = f":{urlsplit(sc.url).port or 80}"
        same = [s for s in same if s.hello.server.endswith(port)]
    return same[0] if len(same) == 1 else None


def _reconcile(f: Families, st: EngineState, vm: Any) -> None:
    lv = [st.server, st.engine, st.hello.model]
    if vm.preemptions is not None:
        f.g("kvscope_reconciliation_preemptions_diff").add_metric(
            lv, sum(st.counters.preemptions.values()) - vm.preemptions
        )
    if st.ledger.synced and vm.free_blocks is not None:
        f.g("kvscope_reconciliation_free_blocks_diff").add_metric(
            lv, st.ledger.free - vm.free_blocks
        )


def _coarse(f: Families, sc: VllmScraper, vm: Any) -> None:
    lv = [urlsplit(sc.url).netloc.rpartition("@")[2], vm.engine, vm.model]
    f.g("kvscope_engine_coarse").add_metric(lv, 1)
    if vm.free_blocks is not None:
        f.g("vllm_scheduler_free_blocks").add_metric(lv, vm.free_blocks)
        f.g("vllm_scheduler_total_blocks").add_metric(lv, vm.num_gpu_blocks - 1)
    if vm.usage is not None:
        f.g("vllm_scheduler_kv_block_usage_ratio").add_metric(lv, vm.usage)
    if vm.preemptions is not None:
        f.c("vllm_scheduler_preempted_requests", EL + ["reason"]).add_metric(
            lv + ["unknown"], vm.preemptions
        )
    if vm.running is not None:
        f.g("vllm_scheduler_running_requests").add_metric(lv, vm.running)
    if vm.waiting is not None:
        f.g("vllm_scheduler_waiting_requests").add_metric(lv, vm.waiting)


def gpu_families(f: Families, gpu: GpuReader) -> None:
    if not gpu.available:
        return
    for s in gpu.sample():
        lv = [str(s.index), s.name]
        f.g("kvscope_gpu_memory_used_bytes", ["gpu", "name"]).add_metric(
            lv, s.memory_used_bytes
        )
        f.g("kvscope_gpu_memory_total_bytes", ["gpu", "name"]).add_metric(
            lv, s.memory_total_bytes
        )
        f.g("kvscope_gpu_utilization_ratio", ["gpu", "name"]).add_metric(
            lv, s.utilization_ratio
        )
