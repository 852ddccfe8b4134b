"""Layer 1 exposition from a Hub, read back through a fresh registry."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, generate_latest

from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.sidecar.exposition.process import ProcessReader
from kvscope.sidecar.exposition.vllm_metrics import VllmScraper, parse
from kvscope.state.hub import Hub
from kvscope_probe import identity, wire
from tests.unit.test_hub import feed, keyframe
from tests.unit.test_vllm_metrics import TEXT
from tests.unit.test_wire import hello, step

L = {"server": "", "engine": "0", "model": "tiny"}


def registry_for(hub: Hub, **kw: object) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub, **kw))  # type: ignore[arg-type]
    return reg


def busy_hub() -> Hub:
    hub = Hub()
    feed(hub, [hello(), step(), keyframe()], 0)
    pre = wire.Preemption("v", 1, 0, 64, 5, 0, "r", 0, 6, "fcfs", "kv_full", 1.0)
    s = step(ops=[(wire.OP_ALLOC, [1, 2, 4])], new_reqs=[wire.NewReq("a", [[1, 2, 4]], 0)],
             num_scheduled={"a": 70}, scheduled_tokens=70, free_blocks=4, running=1,
             waiting=2, head_blocks_needed=9, preemptions=[pre], preempted=["v"])
    feed(hub, [s], 3)
    return hub


def test_block_state_and_budget_metrics() -> None:
    reg = registry_for(busy_hub())
    v = reg.get_sample_value
    assert v("vllm_scheduler_free_blocks", L) == 4
    assert v("vllm_scheduler_total_blocks", L) == 7
    assert v("vllm_scheduler_used_blocks", L) == 3
    assert v("vllm_scheduler_max_contiguous_free_blocks", L) == 3  # blocks 5, 6, 7
    assert v("vllm_scheduler_free_block_runs", {**L, "le": "1"}) == 1  # block 3 alone
    assert v("vllm_scheduler_free_block_runs", {**L, "le": "+Inf"}) == 2
    assert v("vllm_scheduler_tail_waste_tokens", L) == 3 * 32 - 70
    assert abs(v("vllm_scheduler_kv_token_occupancy_ratio", L) - 70 / 96) < 1e-12
    assert v("vllm_scheduler_preempted_requests_total", {**L, "reason": "kv_full"}) == 1
    assert v("vllm_scheduler_preempted_requests_total", {**L, "reason": "unknown"}) == 0
    assert v("vllm_scheduler_scheduled_tokens_total", L) == 70
    assert v("vllm_scheduler_token_budget_tokens_total", L) == 1024
    assert v("vllm_scheduler_waiting_head_blocks_needed", L) == 9
    assert v("kvscope_ledger_synced", L) == 1
    assert v("kvscope_probe_records_received_total") == 4


def test_stale_ledger_exports_no_block_gauges() -> None:
    hub = busy_hub()
    feed(hub, [step()], 10)  # a gap
    reg = registry_for(hub)
    assert reg.get_sample_value("kvscope_ledger_synced", L) == 0
    assert reg.get_sample_value("vllm_scheduler_free_blocks", L) is None
    assert reg.get_sample_value("vllm_scheduler_preempted_requests_total",
                                {**L, "reason": "kv_full"}) == 1


def test_the_engine_process_series_stay_while_the_ledger_is_stale() -> None:
    """The engine's CPU and memory do not depend on the pool's state: a counter that
    vanished at every gap would break rate() over it. The hello names this very process
    (a real one on this host) as the engine."""
    hub = Hub()
    me = hello(pid=os.getpid(), started=identity.process_start_time(os.getpid()))
    feed(hub, [me, step(), keyframe()], 0)
    reg = registry_for(hub, processes=ProcessReader())
    assert reg.get_sample_value("kvscope_engine_process_cpu_seconds_total", L) > 0
    feed(hub, [step()], 10)  # a gap: the ledger is stale until the next keyframe
    assert reg.get_sample_value("kvscope_ledger_synced", L) == 0
    assert reg.get_sample_value("kvscope_engine_process_cpu_seconds_total", L) > 0
    assert reg.get_sample_value("kvscope_engine_process_resident_memory_bytes", L) > 0


def test_an_engine_pid_of_another_namespace_reads_no_process_figures() -> None:
    """The engine in another container: its hello's PID is a process here too (here, this
    one), started at another time. Its CPU and memory would be another process's: none
    are exported."""
    hub = Hub()
    other = hello(pid=os.getpid(), started=identity.process_start_time(os.getpid()) - 3600)
    feed(hub, [other, step(), keyframe()], 0)
    reg = registry_for(hub, processes=ProcessReader())
    assert reg.get_sample_value("kvscope_ledger_synced", L) == 1
    assert reg.get_sample_value("kvscope_engine_process_cpu_seconds_total", L) is None
    assert reg.get_sample_value("kvscope_engine_process_resident_memory_bytes", L) is None


def test_coarse_mode_and_reconciliation_from_vllm_metrics() -> None:
    scraper = VllmScraper("http://127.0.0.1:1")
    scraper.latest = parse(TEXT)
    reg = registry_for(Hub(), vllm=scraper)
    coarse = {**L, "server": "127.0.0.1:1"}  # the --vllm-url's host:port names its server
    assert reg.get_sample_value("kvscope_engine_coarse", coarse) == 1
    assert reg.get_sample_value("vllm_scheduler_free_blocks", coarse) == 35
    hub = busy_hub()
    reg = registry_for(hub, vllm=scraper)
    assert reg.get_sample_value("kvscope_engine_coarse", coarse) is None
    assert reg.get_sample_value("kvscope_reconciliation_preemptions_diff", L) == 1 - 25
    assert reg.get_sample_value("kvscope_reconciliation_free_blocks_diff", L) == 4 - 35


def test_exposition_has_help_for_every_family() -> None:
    text = generate_latest(registry_for(busy_hub())).decode()
    helps = [ln for ln in text.splitlines() if ln.startswith("# HELP")]
    assert helps and all(len(h.split(" ", 3)) == 4 for h in helps)


def empty_pool_of(groups: list[wire.KVGroup], block_size: int = 32) -> Hub:
    """A hub holding one engine of these KV cache groups, its 8-block pool free (block 0
    null), after a keyframe."""
    h = hello(kv_groups=groups, block_size=block_size)
    kf = wire.Keyframe(hello=h, states=bytes([3] + [0] * 7), tables={}, tokens={})
    hub = Hub()
    feed(hub, [h, step(), kf], 0)
    return hub


def test_hybrid_groups_report_tail_waste_and_blocks_per_group() -> None:
    """Full attention (group 0) and a sliding window (group 1) of 32-token blocks; the
    window released block 3, now a null placeholder of the request's group-1 table."""
    hub = empty_pool_of([wire.KVGroup("FullAttentionSpec", 32),
                         wire.KVGroup("SlidingWindowSpec", 32)])
    admit = step(ops=[(wire.OP_ALLOC, [1, 2, 3, 4])], free_blocks=3, running=1,
                 new_reqs=[wire.NewReq("a", [[1, 2], [3, 4]], 0)], num_scheduled={"a": 64})
    slide = step(ops=[(wire.OP_FREE, [3]), (wire.OP_ALLOC, [5, 6])], free_blocks=2, running=1,
                 num_scheduled={"a": 1}, cached_ids=["a"], cached_computed=[64],
                 nulled=[wire.Nulled("a", 1, [3])], grown_ids=["a"], grown_blocks=[[[5], [6]]])
    feed(hub, [admit, slide], 3)
    assert hub.engines["0"].ledger.tables["a"] == [[1, 2, 5], [0, 4, 6]]
    reg = registry_for(hub)
    v = reg.get_sample_value
    full, sliding = ({**L, "kv_group": "0", "kind": "FullAttentionSpec"},
                     {**L, "kv_group": "1", "kind": "SlidingWindowSpec"})
    assert (v("vllm_scheduler_kv_group_tail_waste_tokens", full),
            v("vllm_scheduler_kv_group_tail_waste_tokens", sliding)) == (96 - 65, 96 - 65)
    assert v("vllm_scheduler_tail_waste_tokens", L) == 2 * (96 - 65)
    assert (v("vllm_scheduler_kv_group_request_blocks", full),
            v("vllm_scheduler_kv_group_request_blocks", sliding)) == (3, 2)
    assert v("vllm_scheduler_used_blocks", L) == 5 and v("kvscope_ledger_synced", L) == 1


def test_a_mamba_groups_state_blocks_hold_no_token_slots() -> None:
    """vLLM's ``MambaSpec`` page is one request's recurrent state whatever its
    ``block_size`` (``page_size_bytes`` reads only the state's shapes): without prefix
    caching its block size is ``max_model_len`` (1024 here) and each request holds one
    such block. Counting ``1024 - tokens`` unfilled slots in it reported a waste that does
    not exist and drove the occupancy ratio below zero."""
    hub = empty_pool_of([wire.KVGroup("MambaSpec", 1024), wire.KVGroup("FullAttentionSpec", 32)],
                        block_size=1024)  # the scheduler's, as vLLM's hello reads it
    admit = step(ops=[(wire.OP_ALLOC, [1, 2, 3, 4])], free_blocks=3, running=1,
                 new_reqs=[wire.NewReq("a", [[4], [1, 2, 3]], 0)], num_scheduled={"a": 65})
    feed(hub, [admit], 3)
    v = registry_for(hub).get_sample_value
    mamba, full = ({**L, "kv_group": "0", "kind": "MambaSpec"},
                   {**L, "kv_group": "1", "kind": "FullAttentionSpec"})
    assert v("vllm_scheduler_kv_group_tail_waste_tokens", mamba) == 0
    assert v("vllm_scheduler_kv_group_tail_waste_tokens", full) == 96 - 65
    assert v("vllm_scheduler_tail_waste_tokens", L) == 96 - 65
    assert (v("vllm_scheduler_kv_group_request_blocks", mamba),
            v("vllm_scheduler_kv_group_request_blocks", full)) == (1, 3)
    # the attention group's 3 blocks of 32 slots; the state block holds none
    assert v("vllm_scheduler_kv_token_occupancy_ratio", L) == 1 - (96 - 65) / 96
