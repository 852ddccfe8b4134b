"""Every metric the sidecar exports, declared once: name, type, labels and help.

The collectors build their families from this table (``kvscope.sidecar.exposition``, and
``kvscope.sinks.metrics`` for the sinks), offer it through ``describe()`` so a duplicate
name is refused when a collector is registered rather than found at scrape time, and the
README's metric table is generated from it (a unit test checks both the README and that
every call site asks for the declared type and labels). Counter names are given without
``_total``, as prometheus_client takes them.

It imports nothing of kvscope (only prometheus_client's family types): every layer may
read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

GAUGE = "gauge"
COUNTER = "counter"
ENGINE = ("server", "engine", "model")
"""An engine's labels: its vLLM server, vLLM's own ``engine`` label (the DP index), model."""


@dataclass(frozen=True)
class Declared:
    name: str
    kind: str
    """GAUGE or COUNTER."""
    labels: tuple[str, ...]
    help: str
    """One sentence, the HELP line."""


SIDECAR_METRICS: tuple[Declared, ...] = (
    Declared("kvscope_client_requests", COUNTER, ("client",),
             "API requests answered, by client (bounded labels)."),
    Declared("kvscope_client_duplicate_requests", COUNTER, ("client",),
             "Requests repeating the same client's prompt within the duplicate window."),
    Declared("kvscope_client_preempted_requests", COUNTER, ("client",),
             "Engine requests preempted at least once, by client."),
    Declared("kvscope_client_preemptions", COUNTER, ("client",),
             "Preemptions of engine requests, by client."),
    Declared("kvscope_user_agent_requests", COUNTER, ("user_agent",),
             "API requests answered, by User-Agent (bounded labels)."),
    Declared("kvscope_user_agent_preemptions", COUNTER, ("user_agent",),
             "Preemptions of engine requests, by User-Agent."),
    Declared("kvscope_client_label_overflow", COUNTER, ("label",),
             "Label values refused a series because the label's cap was reached (shown as "
             "other)."),
    Declared("kvscope_client_traces_joined", COUNTER, (),
             "Request traces joined to a client event."),
    Declared("kvscope_client_traces_unjoined", COUNTER, (),
             "Completion and chat traces written without client fields: no client event arrived, "
             "or concurrent calls shared the request ID."),
    Declared("kvscope_engine_info", GAUGE,
             (*ENGINE, "vllm_version", "policy", "block_size", "num_blocks", "token_budget",
              "max_num_seqs", "dp_rank"),
             "Static facts about an engine the probe reports."),
    Declared("kvscope_probe_feature_disabled", GAUGE, (*ENGINE, "feature"),
             "1 for each probe feature this engine's vLLM did not match the fingerprint of "
             "(not recorded); no series when everything matches; a feature this sidecar "
             "does not know is other."),
    Declared("vllm_scheduler_steps", COUNTER, ENGINE, "Scheduler steps (schedule() calls)."),
    Declared("vllm_scheduler_scheduled_tokens", COUNTER, ENGINE,
             "Tokens scheduled, summed over steps."),
    Declared("vllm_scheduler_token_budget_tokens", COUNTER, ENGINE,
             "Token budget offered, summed over steps; divide scheduled tokens by it over any "
             "window for exact utilization."),
    Declared("vllm_scheduler_preempted_requests", COUNTER, (*ENGINE, "reason"),
             "Preemptions by reason: kv_full, priority or unknown (never contiguity)."),
    Declared("vllm_scheduler_preempted_tokens", COUNTER, ENGINE,
             "Computed tokens discarded by preemptions."),
    Declared("vllm_scheduler_recomputed_tokens", COUNTER, ENGINE,
             "Discarded tokens computed again on resume (prefix-cache hits excluded)."),
    Declared("vllm_scheduler_requests_arrived", COUNTER, ENGINE,
             "Requests added to the scheduler."),
    Declared("vllm_scheduler_requests_ended", COUNTER, (*ENGINE, "status"),
             "Requests that left the scheduler, by vLLM status (other: a status vLLM does not "
             "define)."),
    Declared("vllm_scheduler_token_budget_utilization", GAUGE, ENGINE,
             "Scheduled tokens / token budget over the last 10 s of steps."),
    Declared("vllm_scheduler_running_requests", GAUGE, ENGINE,
             "Requests running after the last step."),
    Declared("vllm_scheduler_waiting_requests", GAUGE, ENGINE,
             "Requests in vLLM's waiting queues after the last step, those it skipped for a "
             "grammar, a KV load or streaming input included (vLLM's own "
             "vllm:num_requests_waiting leaves those out; without the probe, the coarse "
             "figures from --vllm-url are that one)."),
    Declared("vllm_scheduler_waiting_head_blocks_needed", GAUGE, ENGINE,
             "Upper bound on the blocks the head of the waiting queue needs: its whole sequence "
             "and vLLM's speculative lookahead in every KV cache group as if each kept every "
             "block (sliding-window and Mamba groups hold fewer), before prefix-cache hits (0: "
             "nothing waits, or vLLM skips the head for a reason other than blocks: a grammar "
             "compiling, a KV load, streaming input)."),
    Declared("vllm_scheduler_waiting_head_never_fits", GAUGE, ENGINE,
             "1 while the head of the waiting queue needs more blocks than the whole pool holds "
             "(its full-attention groups' blocks alone exceed the usable blocks): it can never be "
             "admitted, and every request behind it waits; 0 otherwise."),
    Declared("kvscope_ledger_synced", GAUGE, ENGINE,
             "1 while the rebuilt pool state is exact, 0 while it is stale (after a gap, until the"
             " next keyframe)."),
    Declared("vllm_scheduler_total_blocks", GAUGE, ENGINE,
             "Usable KV blocks (the null block excluded)."),
    Declared("vllm_scheduler_free_blocks", GAUGE, ENGINE,
             "Free KV blocks, evictable prefix-cache blocks included (what allocation checks)."),
    Declared("kvscope_engine_unfinished_requests", GAUGE, ENGINE,
             "While the engine is idle (heartbeats, no step): vLLM's own count of the requests "
             "it would step for, from the probe's last heartbeat (0 while paused, sessions "
             "waiting for streaming input left out); vLLM does not schedule while it is 0."),
    Declared("vllm_scheduler_admission_free_blocks", GAUGE, ENGINE,
             "Free KV blocks a waiting or preempted request may take: the free blocks less "
             "vLLM's --watermark reserve while any request runs (equal without one)."),
    Declared("vllm_scheduler_cached_evictable_blocks", GAUGE, ENGINE,
             "Free blocks that still hold prefix-cache data: a prefix-cache hit takes one back, "
             "and handing it to another request evicts its data."),
    Declared("vllm_scheduler_used_blocks", GAUGE, ENGINE, "KV blocks held by requests."),
    Declared("vllm_scheduler_max_contiguous_free_blocks", GAUGE, ENGINE,
             "Longest run of consecutive free block IDs; vLLM V1 never needs contiguity to "
             "allocate."),
    Declared("vllm_scheduler_free_block_runs", GAUGE, (*ENGINE, "le"),
             "Runs of consecutive free block IDs no longer than le blocks (cumulative)."),
    Declared("vllm_scheduler_tail_waste_tokens", GAUGE, ENGINE,
             "Token slots reserved but unfilled in the blocks of running requests (a Mamba "
             "group's blocks hold one recurrent state each, no token slots: none counted)."),
    Declared("vllm_scheduler_kv_group_tail_waste_tokens", GAUGE, (*ENGINE, "kv_group", "kind"),
             "Tail waste per KV cache group (a hybrid model has one group per layer of its "
             "repeating pattern, so several groups may share a kind). A "
             "block a sliding window released held a full block: it is not waste. A Mamba "
             "group's is 0 (its blocks hold states, not token slots)."),
    Declared("vllm_scheduler_kv_group_request_blocks", GAUGE, (*ENGINE, "kv_group", "kind"),
             "Blocks in running requests' tables per KV cache group, null placeholders excluded; a"
             " block shared by two tables counts twice."),
    Declared("vllm_scheduler_kv_block_usage_ratio", GAUGE, ENGINE,
             "Used blocks / usable blocks (vLLM's kv_cache_usage_perc)."),
    Declared("vllm_scheduler_kv_token_occupancy_ratio", GAUGE, ENGINE,
             "Filled token slots / token slots of the running requests' blocks, each KV group "
             "at its own block size (a Mamba group's state blocks hold no slots: not counted); "
             "the gap to 1 is tail waste."),
    Declared("kvscope_engine_process_cpu_seconds", COUNTER, ENGINE,
             "CPU time of the engine process (where the sidecar sees that very process: the "
             "same host and PID namespace)."),
    Declared("kvscope_engine_process_resident_memory_bytes", GAUGE, ENGINE,
             "Resident memory of the engine process (as its CPU time: where the sidecar sees "
             "it)."),
    Declared("kvscope_probe_last_record_age_seconds", GAUGE, ENGINE,
             "Seconds since the last record from this engine's probe."),
    Declared("kvscope_probe_connected", GAUGE, ENGINE,
             "1 when the probe sent a record or a heartbeat within the health timeout (an idle "
             "engine stays connected)."),
    Declared("kvscope_probe_state", GAUGE, (*ENGINE, "state"),
             "1 for the probe's current state: active (steps), idle (heartbeats only), silent "
             "(nothing within the health timeout), gone (the engine process exited). While "
             "silent or gone, the engine's gauges of its pool and queues are absent."),
    Declared("kvscope_probe_heartbeats_received", COUNTER, (), "Heartbeats received from probes."),
    Declared("kvscope_engine_identity_collisions", COUNTER, ("server", "engine"),
             "Probe sessions that claimed the identity of another live engine; kept apart, the "
             "newer with server label <server>#<pid>."),
    Declared("kvscope_probe_connections_refused", COUNTER, ("reason",),
             "tcp connection attempts refused by CURVE authentication, by reason (auth, crypto, "
             "mechanism, protocol)."),
    Declared("kvscope_receiver_queued_bytes", GAUGE, (),
             "Bytes of frames received but not yet ingested."),
    Declared("kvscope_receiver_queue_limit_bytes", GAUGE, (),
             "Bound of that queue; frames arriving while it is full are refused (buffer_full)."),
    Declared("kvscope_probe_records_dropped", COUNTER, ENGINE,
             "Records the probe dropped instead of blocking vLLM (as it reports them)."),
    Declared("kvscope_probe_faults", COUNTER, ENGINE, "Errors the probe contained inside vLLM."),
    Declared("kvscope_probe_overhead_seconds", COUNTER, (*ENGINE, "thread"),
             "Time the probe spent in the engine process, by thread: on the engine thread its step"
             " records and wrappers (wall time), on its sender thread and on libzmq's threads for "
             "its socket (zmq_io) CPU time."),
    Declared("kvscope_probe_ring_bytes", GAUGE, ENGINE,
             "Encoded records the probe holds in the engine process for the sidecar (its ring), as"
             " of its last frame."),
    Declared("kvscope_probe_ring_limit_bytes", GAUGE, ENGINE,
             "Bound of that ring; records beyond it are dropped and counted."),
    Declared("kvscope_engine_schedule_seconds", COUNTER, ENGINE, "Time vLLM spent in schedule()."),
    Declared("kvscope_ledger_gaps", COUNTER, ENGINE, "Gaps in the probe's record sequence."),
    Declared("kvscope_ledger_mismatches", COUNTER, ENGINE,
             "Self-checks (keyframes, free counts) the ledger failed."),
    Declared("kvscope_audit_blocks", COUNTER, ENGINE,
             "Blocks of vLLM's own pool (BlockPool.blocks) compared with the ledger: a slice "
             "after one step in 8, every block once per 4,096 steps."),
    Declared("kvscope_audit_tables", COUNTER, ENGINE,
             "Running requests' block tables read from vLLM's manager and compared with the "
             "ledger (one each audit, in turn)."),
    Declared("kvscope_audit_mismatches", COUNTER, (*ENGINE, "kind"),
             "What the audit found different from vLLM's pool: blocks whose ledger state differs "
             "(block_state), request tables that differ (request_table), blocks the probe's own "
             "mirror had wrong (probe_mirror). 0 while kvscope's figures are exact."),
    Declared("kvscope_audit_pass_seconds", GAUGE, ENGINE,
             "Time the last whole pass of the audit over the pool took (absent before the first)."),
    Declared("kvscope_probe_frames_received", COUNTER, (), "Probe frames accepted."),
    Declared("kvscope_probe_records_received", COUNTER, (), "Probe records accepted."),
    Declared("kvscope_probe_frames_rejected", COUNTER, ("reason",),
             "Probe frames refused, by reason."),
    Declared("kvscope_vllm_scrapes", COUNTER, (), "Scrapes of vLLM's /metrics."),
    Declared("kvscope_vllm_scrape_errors", COUNTER, (), "Failed scrapes of vLLM's /metrics."),
    Declared("kvscope_reconciliation_preemptions_diff", GAUGE, ENGINE,
             "kvscope's preemptions minus vllm:num_preemptions_total at its last scrape. vLLM "
             "counts a preemption when its victim next emits a token, never for one aborted "
             "first: above 0 while victims wait or after such aborts; below 0, kvscope missed "
             "preemptions."),
    Declared("kvscope_reconciliation_free_blocks_diff", GAUGE, ENGINE,
             "kvscope's free blocks minus those derived from vllm:kv_cache_usage_perc; 0 at rest, "
             "jitters under load."),
    Declared("kvscope_engine_coarse", GAUGE, ENGINE,
             "1: this engine is seen only through vLLM's /metrics (no probe), so only coarse "
             "figures exist."),
    Declared("kvscope_sidecar_cpu_seconds", COUNTER, ("thread",),
             "CPU the sidecar itself used, by thread: each thread kvscope names (ingest, "
             "receiver, layout, the sinks'...), main (in kvscope serve the HTTP server's), other "
             "(the embedded store's own, libzmq's, uvloop's)."),
    Declared("kvscope_sidecar_resident_memory_bytes", GAUGE, (),
             "Resident memory of the sidecar's process."),
    Declared("kvscope_gpu_memory_used_bytes", GAUGE, ("gpu", "name"), "GPU memory in use (NVML)."),
    Declared("kvscope_gpu_memory_total_bytes", GAUGE, ("gpu", "name"),
             "GPU memory in total (NVML)."),
    Declared("kvscope_gpu_utilization_ratio", GAUGE, ("gpu", "name"),
             "GPU busy fraction over NVML's last sample period."),
)
"""What ``kvscope.sidecar.exposition``'s collector exports."""
SINK_METRICS: tuple[Declared, ...] = (
    Declared("kvscope_sink_rows_written", COUNTER, ("sink", "table"),
             "Rows a sink's store acknowledged."),
    Declared("kvscope_sink_rows_dropped", COUNTER, ("sink", "table"),
             "Rows a sink gave up: memory queue overflow, full spool, or a batch the store refused"
             " for good."),
    Declared("kvscope_sink_errors", COUNTER, ("sink",),
             "Failed attempts to spool or deliver a batch."),
    Declared("kvscope_sink_spool_bytes", GAUGE, ("sink",),
             "Bytes of batches waiting in a sink's on-disk spool."),
    Declared("kvscope_sink_oldest_unsent_age_seconds", GAUGE, ("sink",),
             "Age of the oldest row a sink took but its store has not acknowledged (0: none)."),
    Declared("kvscope_sink_connected", GAUGE, ("sink",),
             "1 when a sink's last attempt to reach its store (a batch, or an idle check "
             "every 30 s) succeeded; 0 before the first."),
)
"""What ``kvscope.sinks.metrics``' collector exports."""
METRICS = SIDECAR_METRICS + SINK_METRICS
BY_NAME = {m.name: m for m in METRICS}


def markdown_table() -> str:
    """The README's table of every metric: exposed name (a counter's ends in ``_total``)
    with its labels in braces (an engine's three said apart), type and help."""
    lines = ["| metric | type | engine labels | meaning |", "| --- | --- | --- | --- |"]
    for m in METRICS:
        name = m.name + ("_total" if m.kind == COUNTER else "")
        per_engine = set(ENGINE) <= set(m.labels)
        own = [label for label in m.labels if not per_engine or label not in ENGINE]
        braces = "{" + ",".join(own) + "}" if own else ""
        engine = "yes" if per_engine else "no"
        lines.append(f"| `{name}{braces}` | {m.kind} | {engine} | {m.help} |")
    return "\n".join(lines)


SCRAPE_SERIES = ("up", "scrape_duration_seconds", "scrape_samples_scraped")
"""Series Prometheus itself writes for each scrape target."""


def series(name: str) -> str:
    """``name`` itself, when it is a series kvscope exports (a counter asked for with its
    ``_total``); raises KeyError otherwise. The alert and dashboard generators pass every
    metric they query through this, so a renamed or undeclared metric fails generation.
    Recording rules (``level:metric:op``), vLLM's own ``vllm:`` series and the series
    Prometheus writes for every scrape (``up``) pass as they are."""
    if ":" in name or name in SCRAPE_SERIES:
        return name
    base = name.removesuffix("_total")
    m = BY_NAME.get(base)
    if m is None or (m.kind == COUNTER) != (name != base):
        raise KeyError(f"{name} is not a series kvscope declares (kvscope.metric_table)")
    return name


def family(m: Declared) -> Metric:
    """An empty family of ``m``, for ``describe()`` and for a scrape to fill."""
    kind = GaugeMetricFamily if m.kind == GAUGE else CounterMetricFamily
    return kind(m.name, m.help, labels=list(m.labels))
