"""The series budget: how many Prometheus series one sidecar exports, family by family.

A table built from the constants the collectors use (reasons, probe states, run buckets,
refusal reasons), so a test can compare it with a real scrape sample name by sample name:
a family added without its budget, or a label that grows past it, fails that test.

What grows a budget: KV cache groups (two series each), the vLLM finish statuses an engine
has seen (at most ``MAX_END_STATUSES``), each engine a sidecar serves, each sink table, each
GPU, and the two outside labels (client, user agent), each held to its cap plus ``other``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvscope.sidecar.exposition.metrics import RUN_BUCKETS
from kvscope.sidecar.exposition.own_cpu import THREAD_LABELS
from kvscope.sidecar.ingest.auth import REASONS as REFUSALS
from kvscope.state.audit import KINDS as AUDIT_KINDS
from kvscope.state.presence import STATES
from kvscope_probe import wire

MAX_END_STATUSES = len(wire.END_STATUSES) + 1
"""vLLM's finished RequestStatus values (stopped, length capped, aborted, ignored, error,
repetition) and ``other`` (any status outside them): the ``status`` label of
``vllm_scheduler_requests_ended_total``."""
FRAME_REJECTIONS = 8
"""Reasons of ``kvscope_probe_frames_rejected_total`` (exported at 0 from the start)."""
OVERHEAD_THREADS = 3
CLIENT_FAMILIES = ("requests", "duplicate_requests", "preempted_requests", "preemptions")
AGENT_FAMILIES = ("requests", "preemptions")


@dataclass(frozen=True)
class EngineShape:
    """What varies one engine's series."""

    kv_groups: int = 1
    end_statuses: int = 1
    reconciled: bool = False
    """The sidecar scrapes this engine's vLLM /metrics (--vllm-url): two diff gauges."""
    audit_passed: bool = True
    """The audit has covered the pool once (4,096 steps at most): its pass time."""


def engine_series(shape: EngineShape) -> Counter[str]:
    """Series of one synced, stepping engine, by sample name."""
    one = [
        "kvscope_engine_info", "vllm_scheduler_steps_total",
        "vllm_scheduler_scheduled_tokens_total", "vllm_scheduler_token_budget_tokens_total",
        "vllm_scheduler_preempted_tokens_total", "vllm_scheduler_recomputed_tokens_total",
        "vllm_scheduler_requests_arrived_total", "vllm_scheduler_token_budget_utilization",
        "vllm_scheduler_running_requests", "vllm_scheduler_waiting_requests",
        "vllm_scheduler_waiting_head_blocks_needed", "vllm_scheduler_waiting_head_never_fits",
        "kvscope_ledger_synced", "vllm_scheduler_total_blocks", "vllm_scheduler_free_blocks",
        "vllm_scheduler_admission_free_blocks", "vllm_scheduler_cached_evictable_blocks",
        "vllm_scheduler_used_blocks",
        "vllm_scheduler_max_contiguous_free_blocks", "vllm_scheduler_tail_waste_tokens",
        "vllm_scheduler_kv_block_usage_ratio", "vllm_scheduler_kv_token_occupancy_ratio",
        "kvscope_engine_process_cpu_seconds_total",
        "kvscope_engine_process_resident_memory_bytes",
        "kvscope_probe_last_record_age_seconds", "kvscope_probe_connected",
        "kvscope_probe_records_dropped_total", "kvscope_probe_faults_total",
        "kvscope_probe_ring_bytes", "kvscope_probe_ring_limit_bytes",
        "kvscope_engine_schedule_seconds_total", "kvscope_ledger_gaps_total",
        "kvscope_ledger_mismatches_total", "kvscope_audit_blocks_total",
        "kvscope_audit_tables_total",
    ]
    c = Counter(one)
    c["vllm_scheduler_preempted_requests_total"] = len(wire.REASONS)
    c["vllm_scheduler_requests_ended_total"] = shape.end_statuses
    c["vllm_scheduler_free_block_runs"] = len(RUN_BUCKETS) + 1  # and +Inf
    c["vllm_scheduler_kv_group_tail_waste_tokens"] = shape.kv_groups
    c["vllm_scheduler_kv_group_request_blocks"] = shape.kv_groups
    c["kvscope_probe_state"] = len(STATES)
    c["kvscope_probe_overhead_seconds_total"] = OVERHEAD_THREADS
    c["kvscope_audit_mismatches_total"] = len(AUDIT_KINDS)
    if shape.audit_passed:
        c["kvscope_audit_pass_seconds"] = 1
    if shape.reconciled:
        c["kvscope_reconciliation_preemptions_diff"] = 1
        c["kvscope_reconciliation_free_blocks_diff"] = 1
    return c


@dataclass(frozen=True)
class SidecarShape:
    """What varies the series one sidecar exports besides its engines."""

    sink_tables: dict[str, int] = field(default_factory=dict)
    """Each sink's name -> the tables it has written to."""
    clients: int = 0
    """Client label values in use, ``other`` included (at most the cap + 1)."""
    agents: int = 0
    client_families: tuple[str, ...] = CLIENT_FAMILIES[:1]
    """Per-client families with a series (requests from the first; duplicates and
    preemptions once some client has one)."""
    agent_families: tuple[str, ...] = AGENT_FAMILIES[:1]
    vllm_scrapes: bool = False
    gpus: int = 0
    threads: int = 0
    """``thread`` labels of the sidecar's own CPU (``own_cpu.THREAD_LABELS``: at most all)."""


def sidecar_series(shape: SidecarShape) -> Counter[str]:
    """Series of the sidecar itself (receiver, sinks, clients), by sample name."""
    c = Counter(["kvscope_probe_frames_received_total", "kvscope_probe_records_received_total",
                 "kvscope_probe_heartbeats_received_total", "kvscope_receiver_queued_bytes",
                 "kvscope_receiver_queue_limit_bytes", "kvscope_client_traces_joined_total",
                 "kvscope_client_traces_unjoined_total"])
    c["kvscope_probe_frames_rejected_total"] = FRAME_REJECTIONS
    c["kvscope_probe_connections_refused_total"] = len(REFUSALS)
    c["kvscope_client_label_overflow_total"] = 2
    for name in shape.client_families:
        c[f"kvscope_client_{name}_total"] = shape.clients
    for name in shape.agent_families:
        c[f"kvscope_user_agent_{name}_total"] = shape.agents
    for tables in shape.sink_tables.values():
        for fam in ("rows_written_total", "rows_dropped_total"):
            c[f"kvscope_sink_{fam}"] += tables
        for fam in ("errors_total", "spool_bytes", "oldest_unsent_age_seconds", "connected"):
            c[f"kvscope_sink_{fam}"] += 1
    if shape.vllm_scrapes:
        c["kvscope_vllm_scrapes_total"] = c["kvscope_vllm_scrape_errors_total"] = 1
    for fam in ("memory_used_bytes", "memory_total_bytes", "utilization_ratio"):
        if shape.gpus:
            c[f"kvscope_gpu_{fam}"] = shape.gpus
    c["kvscope_sidecar_cpu_seconds_total"] = shape.threads
    c["kvscope_sidecar_resident_memory_bytes"] = 1
    return +c


def ceiling(engines: int, max_clients: int, max_agents: int, sink_tables: dict[str, int],
            *, kv_groups: int = 1, gpus: int = 0) -> int:
    """The most series one sidecar exports for engines its probes record whole: every
    engine at its worst (all finish statuses, reconciled), every client family at its cap
    plus ``other``. Not counted: ``kvscope_probe_feature_disabled`` (one series per feature
    a probe does not record on its vLLM), ``kvscope_engine_identity_collisions``, and
    engines seen only through vLLM's /metrics (``kvscope_engine_coarse`` and up to six
    more each)."""
    worst = EngineShape(kv_groups, MAX_END_STATUSES, reconciled=True)
    side = SidecarShape(sink_tables, max_clients + 1, max_agents + 1, CLIENT_FAMILIES,
                        AGENT_FAMILIES, vllm_scrapes=True, gpus=gpus,
                        threads=len(THREAD_LABELS))
    return engines * sum(engine_series(worst).values()) + sum(sidecar_series(side).values())


def scraped(text: str) -> Counter[str]:
    """Series in an exposition, by sample name (each histogram bucket is one)."""
    c: Counter[str] = Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            c[s.name] += 1
    return c
