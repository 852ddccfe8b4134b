"""The help text of every metric the sidecar exports, and the families a scrape builds.

One name per metric: ``DOCS`` holds each name once; ``Families`` creates a family the
first time a scrape names it and yields them in that order.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

EL = ["server", "engine", "model"]
"""An engine's labels."""
EL = ["server", "engine", "model"]
DOCS = {
    "kvscope_client_requests": "API requests answered, by client (bounded labels).",
    "kvscope_client_duplicate_requests": (
        "Requests repeating the same client's prompt within the duplicate window."
    ),
    "kvscope_client_preempted_requests": "Engine requests preempted at least once, by client.",
    "kvscope_client_preemptions": "Preemptions of engine requests, by client.",
    "kvscope_user_agent_requests": "API requests answered, by User-Agent (bounded labels).",
    "kvscope_user_agent_preemptions": "Preemptions of engine requests, by User-Agent.",
    "kvscope_client_label_overflow": (
        "Label values refused a series because the label's cap was reached (shown as other)."
    ),
    "kvscope_client_traces_joined": "Request traces joined to a client event.",
    "kvscope_client_traces_unjoined": (
        "Completion and chat traces written without client fields: no client event "
        "arrived, or concurrent calls shared the request ID."
    ),
    "kvscope_engine_info": ("Static facts about an engine the probe reports."),
    "vllm_scheduler_steps": ("Scheduler steps (schedule() calls)."),
    "vllm_scheduler_scheduled_tokens": ("Tokens scheduled, summed over steps."),
    "vllm_scheduler_token_budget_tokens": (
        "Token budget offered, summed over steps; divide scheduled tokens by it over any "
        "window for exact utilization."
    ),
    "vllm_scheduler_preempted_requests": (
        "Preemptions by reason: kv_full, priority or unknown (never contiguity)."
    ),
    "vllm_scheduler_preempted_tokens": ("Computed tokens discarded by preemptions."),
    "vllm_scheduler_recomputed_tokens": (
        "Discarded tokens computed again on resume (prefix-cache hits excluded)."
    ),
    "vllm_scheduler_requests_arrived": ("Requests added to the scheduler."),
    "vllm_scheduler_requests_ended": ("Requests that left the scheduler, by vLLM status."),
    "vllm_scheduler_token_budget_utilization": (
        "Scheduled tokens / token budget over the last 10 s of steps."
    ),
    "vllm_scheduler_running_requests": ("Requests running after the last step."),
    "vllm_scheduler_waiting_requests": ("Requests waiting after the last step."),
    "vllm_scheduler_waiting_head_blocks_needed": (
        "Blocks the head of the waiting queue needs for its whole sequence, before "
        "prefix-cache hits (0: nothing waits)."
    ),
    "vllm_scheduler_waiting_head_never_fits": (
        "1 while the head of the waiting queue needs more blocks than the whole pool holds "
        "(its full-attention groups' blocks alone exceed the usable blocks): it can never "
        "be admitted, and every request behind it waits; 0 otherwise."
    ),
    "kvscope_ledger_synced": (
        "1 while the rebuilt pool state is exact, 0 while it is stale (after a gap, until"
        " the next keyframe)."
    ),
    "vllm_scheduler_total_blocks": ("Usable KV blocks (the null block excluded)."),
    "vllm_scheduler_free_blocks": (
        "Free KV blocks, evictable prefix-cache blocks included (what allocation checks)."
    ),
    "vllm_scheduler_cached_evictable_blocks": (
        "Free blocks that still hold prefix-cache data and are evicted on reuse."
    ),
    "vllm_scheduler_used_blocks": ("KV blocks held by requests."),
    "vllm_scheduler_max_contiguous_free_blocks": (
        "Longest run of consecutive free block IDs; vLLM V1 never needs contiguity to allocate."
    ),
    "vllm_scheduler_free_block_runs": (
        "Runs of consecutive free block IDs no longer than le blocks (cumulative)."
    ),
    "vllm_scheduler_tail_waste_tokens": (
        "Token slots reserved but unfilled in the blocks of running requests."
    ),
    "vllm_scheduler_kv_group_tail_waste_tokens": (
        "Tail waste per KV cache group (hybrid models have one group per attention kind). "
        "A block a sliding window released held a full block: it is not waste."
    ),
    "vllm_scheduler_kv_group_request_blocks": (
        "Blocks in running requests' tables per KV cache group, null placeholders "
        "excluded; a block shared by two tables counts twice."
    ),
    "vllm_scheduler_kv_block_usage_ratio": (
        "Used blocks / usable blocks (vLLM's kv_cache_usage_perc)."
    ),
    "vllm_scheduler_kv_token_occupancy_ratio": (
        "Filled token slots / token slots of used blocks; the gap to 1 is tail waste."
    ),
    "kvscope_engine_process_cpu_seconds": ("CPU time of the engine process."),
    "kvscope_engine_process_resident_memory_bytes": ("Resident memory of the engine process."),
    "kvscope_probe_last_record_age_seconds": (
        "Seconds since the last record from this engine's probe."
    ),
    "kvscope_probe_connected": (
        "1 when the probe sent a record or a heartbeat within the health timeout (an idle "
        "engine stays connected)."
    ),
    "kvscope_probe_state": (
        "1 for the probe's current state: active (steps), idle (heartbeats only), silent "
        "(nothing within the health timeout), gone (the engine process exited)."
    ),
    "kvscope_probe_heartbeats_received": ("Heartbeats received from probes."),
    "kvscope_engine_identity_collisions": (
        "Probe sessions that claimed the identity of another live engine; kept apart, the "
        "newer with server label <server>#<pid>."
    ),
    "kvscope_probe_connections_refused": (
        "tcp connection attempts refused by CURVE authentication, by reason (auth, crypto, "
        "mechanism, protocol)."
    ),
    "kvscope_receiver_queued_bytes": ("Bytes of frames received but not yet ingested."),
    "kvscope_receiver_queue_limit_bytes": (
        "Bound of that queue; frames arriving while it is full are refused (buffer_full)."
    ),
    "kvscope_probe_records_dropped": (
        "Records the probe dropped instead of blocking vLLM (as it reports them)."
    ),
    "kvscope_probe_faults": ("Errors the probe contained inside vLLM."),
    "kvscope_probe_overhead_seconds": (
        "Time the probe spent in the engine process, by thread: on the engine thread its "
        "step records and wrappers (wall time), on its sender thread and on libzmq's "
        "threads for its socket (zmq_io) CPU time."
    ),
    "kvscope_probe_ring_bytes": (
        "Encoded records the probe holds in the engine process for the sidecar (its "
        "ring), as of its last frame."
    ),
    "kvscope_probe_ring_limit_bytes": (
        "Bound of that ring; records beyond it are dropped and counted."
    ),
    "kvscope_engine_schedule_seconds": ("Time vLLM spent in schedule()."),
    "kvscope_ledger_gaps": ("Gaps in the probe's record sequence."),
    "kvscope_ledger_mismatches": ("Self-checks (keyframes, free counts) the ledger failed."),
    "kvscope_probe_frames_received": ("Probe frames accepted."),
    "kvscope_probe_records_received": ("Probe records accepted."),
    "kvscope_probe_frames_rejected": ("Probe frames refused, by reason."),
    "kvscope_vllm_scrapes": ("Scrapes of vLLM's /metrics."),
    "kvscope_vllm_scrape_errors": ("Failed scrapes of vLLM's /metrics."),
    "kvscope_reconciliation_preemptions_diff": (
        "kvscope's preemptions minus vllm:num_preemptions_total; should stay 0."
    ),
    "kvscope_reconciliation_free_blocks_diff": (
        "kvscope's free blocks minus those derived from vllm:kv_cache_usage_perc; 0 at "
        "rest, jitters under load."
    ),
    "kvscope_engine_coarse": (
        "1: this engine is seen only through vLLM's /metrics (no probe), so only coarse "
        "figures exist."
    ),
    "kvscope_gpu_memory_used_bytes": ("GPU memory in use (NVML)."),
    "kvscope_gpu_memory_total_bytes": ("GPU memory in total (NVML)."),
    "kvscope_gpu_utilization_ratio": ("GPU busy fraction over NVML's last sample period."),
}


class Families:
    """Creates families lazily and yields them in creation order."""

    def __init__(self) -> None:
        self.fams: dict[str, Metric] = {}

    def g(self, name: str, labels: list[str] = EL) -> GaugeMetricFamily:
        if name not in self.fams:
            self.fams[name] = GaugeMetricFamily(name, DOCS[name], labels=labels)
        return self.fams[name]  # type: ignore[return-value]

    def c(self, name: str, labels: list[str] = EL) -> CounterMetricFamily:
        if name not in self.fams:
            self.fams[name] = CounterMetricFamily(name, DOCS[name], labels=labels)
        return self.fams[name]  # type: ignore[return-value]

