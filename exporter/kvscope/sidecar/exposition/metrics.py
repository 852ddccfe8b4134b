"""Layer 1: the Prometheus view of every engine, built fresh from state at each scrape.

Block-state gauges are exported only while an engine's ledger is in sync, and gauges of
what an engine holds now (pool, queues, head) only while its probe is connected (active or
idle): an absent series is honest, a stale one is not. Counters come from the probe's
records and are exported whenever the engine is known. Labels stay bounded: server, engine and model
(an engine's identity: its vLLM server and vLLM's own ``engine`` label, the DP index).
Help texts: ``metric_families``; vLLM's /metrics and the GPUs: ``metrics_outside``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from kvscope.metric_table import SIDECAR_METRICS, family
from kvscope.sidecar.exposition.gpu import GpuReader
from kvscope.sidecar.exposition.metric_families import EL, Families
from kvscope.sidecar.exposition.metrics_outside import gpu_families, vllm_families
from kvscope.sidecar.exposition.own_cpu import OwnCpu
from kvscope.sidecar.exposition.process import ProcessReader
from kvscope.sidecar.exposition.vllm_metrics import VllmScraper
from kvscope.sidecar.ingest.auth import REASONS as REFUSALS
from kvscope.state.capacity import admission_free, head_fit
from kvscope.state.client_stats import ClientStats
from kvscope.state.engine import EngineState
from kvscope.state.hub import Hub
from kvscope.state.presence import CONNECTED, STATES
from kvscope_probe.fingerprint import FEATURES

if TYPE_CHECKING:
    from kvscope.sidecar.ingest.receiver import Receiver


RUN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


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
        own: OwnCpu | None = None,
    ) -> None:
        self.clients = clients
        self.own = own
        self.receiver = receiver
        self.hub = hub
        self.gpu = gpu
        self.processes = processes
        self.vllm = vllm

    def describe(self) -> Iterator[Metric]:
        """The declared families, so a registry refuses a second collector of one name."""
        return (family(m) for m in SIDECAR_METRICS)

    def collect(self) -> Iterator[Metric]:
        f = Families()
        with self.hub.lock:
            for state in self.hub.engines.values():
                self._engine(f, state)
            self._hub(f)
            self._clients(f)
        if self.vllm is not None:
            vllm_families(f, self.hub, self.vllm)
        if self.gpu is not None:
            gpu_families(f, self.gpu)
        if self.own is not None:
            self._own(f, self.own)
        yield from f.fams.values()

    @staticmethod
    def _own(f: Families, own: OwnCpu) -> None:
        """The sidecar's own CPU by thread and memory (outside the hub lock: /proc reads)."""
        by_thread = own.cpu_seconds()
        if by_thread:
            cpu = f.c("kvscope_sidecar_cpu_seconds", ["thread"])
            for thread, seconds in sorted(by_thread.items()):
                cpu.add_metric([thread], seconds)
        rss = own.resident_bytes()
        if rss is not None:
            f.g("kvscope_sidecar_resident_memory_bytes", []).add_metric([], rss)

    # -- per engine -----------------------------------------------------------------
    def _engine(self, f: Families, st: EngineState) -> None:
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
        off = f.g("kvscope_probe_feature_disabled", EL + ["feature"])
        # a feature this sidecar does not know (a newer probe's, or garbage) is "other"
        for feature in dict.fromkeys(x if x in FEATURES else "other"
                                     for x in getattr(h, "disabled", None) or ()):
            off.add_metric(lv + [feature], 1)
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
        state = self.hub.state_of(st)
        self._health(f, st, lv, state)
        self._process(f, st, lv)
        f.g("kvscope_ledger_synced").add_metric(lv, int(st.ledger.synced))
        if state not in CONNECTED:
            # Silent or gone: what its last step left describes a pool and queues nobody
            # hears now (or that no longer exist); absent, not kept in every fleet sum.
            return
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

    def _ledger(self, f: Families, st: EngineState, lv: list[str]) -> None:
        led = st.ledger
        if not led.synced:
            return
        f.g("vllm_scheduler_total_blocks").add_metric(lv, led.usable_blocks)
        f.g("vllm_scheduler_free_blocks").add_metric(lv, led.free)
        last = st.last_step
        f.g("vllm_scheduler_admission_free_blocks").add_metric(
            lv, admission_free(st.hello, led.free, last.running if last is not None else 0))
        f.g("vllm_scheduler_cached_evictable_blocks").add_metric(lv, led.cached)
        f.g("vllm_scheduler_used_blocks").add_metric(lv, led.used)
        f.g("vllm_scheduler_max_contiguous_free_blocks").add_metric(
            lv, led.max_contiguous_free())
        rb = f.g("vllm_scheduler_free_block_runs", EL + ["le"])
        for le, n in zip(RUN_BUCKETS, led.free_runs_at_most(RUN_BUCKETS), strict=True):
            rb.add_metric(lv + [str(le)], n)
        rb.add_metric(lv + ["+Inf"], int(led.free_runs().size))
        by_group, held, slots_by_group = led.group_figures()
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
        slots = sum(slots_by_group)
        f.g("vllm_scheduler_kv_token_occupancy_ratio").add_metric(
            lv, (1.0 - waste / slots) if slots else 1.0
        )

    def _process(self, f: Families, st: EngineState, lv: list[str]) -> None:
        """The engine process's CPU and memory, whatever the ledger's state; only where
        the sidecar sees that very process (its PID's start time is the hello's): in
        another PID namespace (another container) the engine's PID names a process of
        the sidecar's own, often the sidecar itself."""
        presence = self.hub.presence.get(st.hello.session)
        if self.processes is not None and presence is not None and presence.local:
            ps = self.processes.sample(st.hello.pid)
            if ps is not None:
                f.c("kvscope_engine_process_cpu_seconds").add_metric(lv, ps.cpu_seconds)
                f.g("kvscope_engine_process_resident_memory_bytes").add_metric(lv, ps.rss_bytes)

    def _health(self, f: Families, st: EngineState, lv: list[str], state: str) -> None:
        age = time.monotonic() - st.last_record_monotonic
        f.g("kvscope_probe_last_record_age_seconds").add_metric(lv, age)
        f.g("kvscope_probe_connected").add_metric(lv, int(state in CONNECTED))
        states = f.g("kvscope_probe_state", EL + ["state"])
        for name in STATES:
            states.add_metric(lv + [name], int(state == name))
        unfinished = self.hub.presence[st.hello.session].unfinished
        if state == "idle" and unfinished >= 0:  # its heartbeats are all it sends now
            f.g("kvscope_engine_unfinished_requests").add_metric(lv, unfinished)
        c = st.counters
        f.c("kvscope_probe_records_dropped").add_metric(lv, st.probe_dropped)
        f.c("kvscope_probe_faults").add_metric(lv, st.probe_faults)
        over = f.c("kvscope_probe_overhead_seconds", [*EL, "thread"])
        over.add_metric([*lv, "engine"], c.probe_seconds)
        over.add_metric([*lv, "sender"], st.sender_cpu_ns / 1e9)
        over.add_metric([*lv, "zmq_io"], st.io_cpu_ns / 1e9)
        f.g("kvscope_probe_ring_bytes").add_metric(lv, st.ring_bytes)
        f.g("kvscope_probe_ring_limit_bytes").add_metric(lv, st.ring_limit_bytes)
        f.c("kvscope_engine_schedule_seconds").add_metric(lv, c.schedule_seconds)
        f.c("kvscope_ledger_gaps").add_metric(lv, c.gaps)
        f.c("kvscope_ledger_mismatches").add_metric(lv, c.ledger_mismatches)
        au = st.audit
        f.c("kvscope_audit_blocks").add_metric(lv, au.blocks)
        f.c("kvscope_audit_tables").add_metric(lv, au.tables)
        mis = f.c("kvscope_audit_mismatches", [*EL, "kind"])
        for kind, n in au.mismatches.items():
            mis.add_metric([*lv, kind], n)
        if au.pass_seconds is not None:
            f.g("kvscope_audit_pass_seconds").add_metric(lv, au.pass_seconds)

    def _hub(self, f: Families) -> None:
        hub = self.hub
        f.c("kvscope_probe_frames_received", []).add_metric([], hub.frames)
        f.c("kvscope_probe_records_received", []).add_metric([], hub.records)
        rej = f.c("kvscope_probe_frames_rejected", ["reason"])
        for reason in ("parts", "tag", "version", "malformed", "invalid", "unknown_session",
                       "buffer_full", "too_many_engines"):
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

    def _clients(self, f: Families) -> None:
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
