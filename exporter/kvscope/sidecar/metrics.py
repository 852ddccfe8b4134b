"""Layer 1: the Prometheus view of every engine, built fresh from state at each scrape.

Block-state gauges are exported only while an engine's ledger is in sync: an absent
series is honest, a stale one is not. Counters come from the probe's records and are
exported whenever the engine is known. Labels stay bounded: server, engine and model
(an engine's identity: its vLLM server and vLLM's own ``engine`` label, the DP index).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvscope.sidecar.auth import REASONS as REFUSALS
from kvscope.sidecar.capacity import head_fit
from kvscope.sidecar.client_stats import ClientStats
from kvscope.sidecar.engine import EngineState
from kvscope.sidecar.gpu import GpuReader
from kvscope.sidecar.hub import Hub
from kvscope.sidecar.presence import CONNECTED, STATES
from kvscope.sidecar.process import ProcessReader
from kvscope.sidecar.vllm_metrics import VllmScraper

if TYPE_CHECKING:
    from kvscope.sidecar.receiver import Receiver

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
        "step records and wrappers (wall time), on its sender thread (CPU time)."
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
RUN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class _Families:
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


class KVScopeCollector:
    """A prometheus_client collector over the Hub (and optional readers)."""

    def __init__(
        self,
        hub: Hub,
        *,
        gpu: GpuReader | None = None,
        processes: ProcessReader | None = None,
        vllm: VllmScraper | None = None,
        clients: ClientStats | None = None,
        receiver: Receiver | None = None,
    ) -> None:
        self.clients = clients
        self.receiver = receiver
        self.hub = hub
        self.gpu = gpu
        self.processes = processes
        self.vllm = vllm

    def collect(self) -> Iterator[Metric]:
        f = _Families()
        with self.hub.lock:
            for state in self.hub.engines.values():
                self._engine(f, state)
            self._hub(f)
            self._clients(f)
        self._coarse_and_reconcile(f)
        self._gpu(f)
        yield from f.fams.values()

    # -- per engine -----------------------------------------------------------------
    def _engine(self, f: _Families, st: EngineState) -> None:
        h = st.hello
        lv = [st.server, h.engine, h.model]
        c = st.counters
        f.g(
            "kvscope_engine_info",
            [
                "server",
                "engine",
                "model",
                "vllm_version",
                "policy",
                "block_size",
                "num_blocks",
                "token_budget",
                "max_num_seqs",
                "dp_rank",
            ],
        ).add_metric(
            [
                st.server,
                h.engine,
                h.model,
                h.vllm_version,
                h.policy,
                str(h.block_size),
                str(h.num_blocks),
                str(h.token_budget),
                str(h.max_num_seqs),
                str(h.dp_rank),
            ],
            1,
        )
        f.c("vllm_scheduler_steps").add_metric(lv, c.steps)
        f.c("vllm_scheduler_scheduled_tokens").add_metric(lv, c.scheduled_tokens)
        f.c("vllm_scheduler_token_budget_tokens").add_metric(lv, c.budget_tokens)
        pre = f.c("vllm_scheduler_preempted_requests", EL + ["reason"])
        for reason, n in c.preemptions.items():
            pre.add_metric(lv + [reason], n)
        f.c("vllm_scheduler_preempted_tokens").add_metric(lv, c.preempted_tokens)
        f.c("vllm_scheduler_recomputed_tokens").add_metric(lv, c.recomputed_tokens)
        f.c("vllm_scheduler_requests_arrived").add_metric(lv, c.arrivals)
        ends = f.c("vllm_scheduler_requests_ended", EL + ["status"])
        for status, n in c.ends.items():
            ends.add_metric(lv + [status], n)
        util = st.budget_utilization()
        if util is not None:
            f.g("vllm_scheduler_token_budget_utilization").add_metric(lv, util)
        last = st.last_step
        if last is not None:
            f.g("vllm_scheduler_running_requests").add_metric(lv, last.running)
            f.g("vllm_scheduler_waiting_requests").add_metric(lv, last.waiting)
            f.g("vllm_scheduler_waiting_head_blocks_needed").add_metric(lv, last.head_blocks_needed)
            fit = head_fit(h, last)
            f.g("vllm_scheduler_waiting_head_never_fits").add_metric(
                lv, int(fit is not None and fit.never_fits))
        self._ledger(f, st, lv)
        self._health(f, st, lv)

    def _ledger(self, f: _Families, st: EngineState, lv: list[str]) -> None:
        led = st.ledger
        f.g("kvscope_ledger_synced").add_metric(lv, int(led.synced))
        if not led.synced:
            return
        bs = st.hello.block_size
        f.g("vllm_scheduler_total_blocks").add_metric(lv, led.usable_blocks)
        f.g("vllm_scheduler_free_blocks").add_metric(lv, led.free)
        f.g("vllm_scheduler_cached_evictable_blocks").add_metric(lv, led.cached)
        f.g("vllm_scheduler_used_blocks").add_metric(lv, led.used)
        f.g("vllm_scheduler_max_contiguous_free_blocks").add_metric(
            lv, led.max_contiguous_free())
        rb = f.g("vllm_scheduler_free_block_runs", EL + ["le"])
        for le, n in zip(RUN_BUCKETS, led.free_runs_at_most(RUN_BUCKETS), strict=True):
            rb.add_metric(lv + [str(le)], n)
        rb.add_metric(lv + ["+Inf"], int(led.free_runs().size))
        by_group, held = led.group_figures()
        waste = sum(by_group)
        f.g("vllm_scheduler_tail_waste_tokens").add_metric(lv, waste)
        gw = f.g("vllm_scheduler_kv_group_tail_waste_tokens", EL + ["kv_group", "kind"])
        gb = f.g("vllm_scheduler_kv_group_request_blocks", EL + ["kv_group", "kind"])
        for g, (group, w, n) in enumerate(zip(st.hello.kv_groups, by_group,
                                              held, strict=False)):
            gw.add_metric(lv + [str(g), group.kind], w)
            gb.add_metric(lv + [str(g), group.kind], n)
        usable = led.usable_blocks or 1
        f.g("vllm_scheduler_kv_block_usage_ratio").add_metric(lv, led.used / usable)
        slots = led.used * bs
        f.g("vllm_scheduler_kv_token_occupancy_ratio").add_metric(
            lv, (1.0 - waste / slots) if slots else 1.0
        )
        if self.processes is not None:
            ps = self.processes.sample(st.hello.pid)
            if ps is not None:
                f.c("kvscope_engine_process_cpu_seconds").add_metric(lv, ps.cpu_seconds)
                f.g("kvscope_engine_process_resident_memory_bytes").add_metric(lv, ps.rss_bytes)

    def _health(self, f: _Families, st: EngineState, lv: list[str]) -> None:
        age = time.monotonic() - st.last_record_monotonic
        f.g("kvscope_probe_last_record_age_seconds").add_metric(lv, age)
        state = self.hub.state_of(st)
        f.g("kvscope_probe_connected").add_metric(lv, int(state in CONNECTED))
        states = f.g("kvscope_probe_state", EL + ["state"])
        for name in STATES:
            states.add_metric(lv + [name], int(state == name))
        c = st.counters
        f.c("kvscope_probe_records_dropped").add_metric(lv, st.probe_dropped)
        f.c("kvscope_probe_faults").add_metric(lv, st.probe_faults)
        over = f.c("kvscope_probe_overhead_seconds", [*EL, "thread"])
        over.add_metric([*lv, "engine"], c.probe_seconds)
        over.add_metric([*lv, "sender"], st.sender_cpu_ns / 1e9)
        f.c("kvscope_engine_schedule_seconds").add_metric(lv, c.schedule_seconds)
        f.c("kvscope_ledger_gaps").add_metric(lv, c.gaps)
        f.c("kvscope_ledger_mismatches").add_metric(lv, c.ledger_mismatches)

    def _hub(self, f: _Families) -> None:
        hub = self.hub
        f.c("kvscope_probe_frames_received", []).add_metric([], hub.frames)
        f.c("kvscope_probe_records_received", []).add_metric([], hub.records)
        rej = f.c("kvscope_probe_frames_rejected", ["reason"])
        for reason in ("parts", "tag", "version", "malformed", "invalid", "unknown_session",
                       "buffer_full"):
            rej.add_metric([reason], hub.rejected.get(reason, 0))
        f.c("kvscope_probe_heartbeats_received", []).add_metric([], hub.heartbeats)
        coll = f.c("kvscope_engine_identity_collisions", ["server", "engine"])
        for (server, engine), n in sorted(hub.collisions.items()):
            coll.add_metric([server, engine], n)
        rx = self.receiver
        if rx is not None:
            refused = rx.refused()
            fam = f.c("kvscope_probe_connections_refused", ["reason"])
            for reason in REFUSALS:
                fam.add_metric([reason], refused.get(reason, 0))
            f.g("kvscope_receiver_queued_bytes", []).add_metric([], rx.queue.bytes)
            f.g("kvscope_receiver_queue_limit_bytes", []).add_metric([], rx.queue.max_bytes)

    def _clients(self, f: _Families) -> None:
        cs = self.clients
        if cs is None:
            return
        for name, values, label in (
            ("kvscope_client_requests", cs.requests, "client"),
            ("kvscope_client_duplicate_requests", cs.duplicates, "client"),
            ("kvscope_client_preempted_requests", cs.preempted_requests, "client"),
            ("kvscope_client_preemptions", cs.preemptions, "client"),
            ("kvscope_user_agent_requests", cs.agent_requests, "user_agent"),
            ("kvscope_user_agent_preemptions", cs.agent_preemptions, "user_agent"),
        ):
            fam = f.c(name, [label])
            for value, n in values.items():
                fam.add_metric([value], n)
        over = f.c("kvscope_client_label_overflow", ["label"])
        over.add_metric(["client"], cs.clients.overflow)
        over.add_metric(["user_agent"], cs.agents.overflow)
        f.c("kvscope_client_traces_joined", []).add_metric([], cs.joined_traces)
        f.c("kvscope_client_traces_unjoined", []).add_metric([], cs.unjoined_traces)

    # -- vLLM's own metrics ----------------------------------------------------------------
    def _coarse_and_reconcile(self, f: _Families) -> None:
        if self.vllm is None:
            return
        sc = self.vllm
        f.c("kvscope_vllm_scrapes", []).add_metric([], sc.scrapes)
        f.c("kvscope_vllm_scrape_errors", []).add_metric([], sc.errors)
        for vm in sc.latest.values():
            with self.hub.lock:
                st = self._probed(vm.engine)
                if st is not None:
                    self._reconcile(f, st, vm)
                    continue
            self._coarse(f, vm)

    def _probed(self, engine: str) -> EngineState | None:
        """The probed engine that vLLM's ``engine`` label at --vllm-url means: the only one
        with that label, or the only one whose server has the URL's port."""
        assert self.vllm is not None
        same = [s for s in self.hub.engines.values() if s.engine == engine]
        if len(same) > 1:
            port = f":{urlsplit(self.vllm.url).port or 80}"
            same = [s for s in same if s.hello.server.endswith(port)]
        return same[0] if len(same) == 1 else None

    def _reconcile(self, f: _Families, st: EngineState, vm: Any) -> None:
        lv = [st.server, st.engine, st.hello.model]
        if vm.preemptions is not None:
            f.g("kvscope_reconciliation_preemptions_diff").add_metric(
                lv, sum(st.counters.preemptions.values()) - vm.preemptions
            )
        if st.ledger.synced and vm.free_blocks is not None:
            f.g("kvscope_reconciliation_free_blocks_diff").add_metric(
                lv, st.ledger.free - vm.free_blocks
            )

    def _coarse(self, f: _Families, vm: Any) -> None:
        assert self.vllm is not None
        lv = [urlsplit(self.vllm.url).netloc.rpartition("@")[2], vm.engine, vm.model]
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

    def _gpu(self, f: _Families) -> None:
        if self.gpu is None or not self.gpu.available:
            return
        for s in self.gpu.sample():
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
