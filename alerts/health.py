"""Alerts on kvscope itself: the probe, the ledger, the receiver, the sidecar and its sinks.

None of these pages: vLLM keeps serving while kvscope is blind. But a blind kvscope cannot
page for the pool either (the P1 needs the ledger in sync), so they are warnings.
"""

from __future__ import annotations

from alerts.config import Config
from alerts.promql import Promql, Rule, alert

ID = "{{ $labels.server }}/{{ $labels.engine }} ({{ $labels.model }})"
PROBE = f"The kvscope probe in engine {ID}"
LEDGER = f"kvscope's rebuilt block pool of engine {ID}"
SIDECAR = "The kvscope sidecar {{ $labels.instance }}"
SINK = "Sink {{ $labels.sink }} of the kvscope sidecar {{ $labels.instance }}"


def probe_state(q: Promql, name: str) -> str:
    """1 while the probe is in this state (kvscope.state.presence)."""
    return q.m("kvscope_probe_state", f'state="{name}"')


def probe_alerts(cfg: Config) -> list[Rule]:
    q = Promql(cfg)
    w = cfg.probe_problem_window
    disabled = q.m("kvscope_probe_feature_disabled", 'feature!="hash_field"')
    busy = (
        f"{q.by_engine('sum', q.m('vllm_scheduler_running_requests'))}\n+\n"
        f"{q.by_engine('sum', q.m('vllm_scheduler_waiting_requests'))}\n> 0"
    )
    return [
        alert(
            cfg,
            "KVScopeProbeSilent",
            # An idle engine's probe heartbeats (state idle, connected): only silence is
            # alarming. A dead engine the sidecar can check reads gone instead.
            f"{q.by_engine('max', probe_state(q, 'silent'))} == 1",
            severity="warning",
            for_=cfg.probe_silent_for,
            summary="The kvscope probe of an engine stopped sending records and heartbeats.",
            description=f"{PROBE} has sent neither records nor heartbeats for longer than "
            f"the sidecar's health timeout, for {cfg.probe_silent_for}. Either the probe "
            "cannot reach the sidecar, or the engine process died where the sidecar cannot "
            "check its PID (another host or PID namespace). Pool alerts are blind for it.",
            dashboard=cfg.dashboards.blocks,
        ),
        alert(
            cfg,
            "KVScopeEngineGone",
            f"{q.by_engine('max', probe_state(q, 'gone'))} == 1",
            severity="warning",
            for_=cfg.engine_gone_for,
            summary="An engine process exited and no new one took its identity.",
            description=f"The EngineCore process of engine {ID} exited (the sidecar watched "
            f"its PID) and no probe session has replaced it for {cfg.engine_gone_for}: "
            "vLLM is down or was moved, unless this server was retired on purpose.",
            dashboard=cfg.dashboards.blocks,
        ),
        alert(
            cfg,
            "KVScopeEngineStalled",
            f"{q.by_engine('max', probe_state(q, 'idle'))} == 1\n"
            f"and\n{busy}\nunless\n"
            f"{q.by_engine('max', q.m('kvscope_engine_unfinished_requests'))} == 0",
            severity="warning",
            for_=cfg.engine_stalled_for,
            summary="An engine stopped scheduling although its last step left requests.",
            description=f"{PROBE} keeps sending heartbeats but no step for longer than the "
            "health timeout, although the last step left requests running or waiting and "
            "vLLM does not count them all done or paused: vLLM's engine loop is stuck (the "
            "process lives, schedule() is not called).",
            dashboard=cfg.dashboards.blocks,
        ),
        alert(
            cfg,
            "KVScopeProbeRecordsDropped",
            f"{q.increase('kvscope_probe_records_dropped_total', w)} > 0",
            severity="warning",
            for_=cfg.probe_dropped_for,
            summary="The kvscope probe is dropping records instead of blocking vLLM.",
            description=f"{PROBE} dropped {{{{ $value | humanize }}}} records in the last "
            f"{w}. After each drop the sidecar's view of the pool is stale until the next "
            "keyframe: block gauges are absent and the P1 alert is blind meanwhile.",
            dashboard=cfg.dashboards.blocks,
        ),
        alert(
            cfg,
            "KVScopeProbeFaults",
            f"{q.increase('kvscope_probe_faults_total', w)} > 0",
            severity="warning",
            summary="The kvscope probe contained errors inside vLLM.",
            description=f"{PROBE} caught {{{{ $value | humanize }}}} errors of its own in "
            f"the last {w}. vLLM was not affected, but the probe switches itself off after "
            "1000 of them.",
            dashboard=cfg.dashboards.blocks,
        ),
        alert(
            cfg,
            "KVScopeProbeFeatureDisabled",
            # hash_field is only a faster read of a block's hash: nothing is lost without it.
            f"max by ({q.engine}, feature) ({disabled}) == 1",
            severity="warning",
            summary="The kvscope probe does not record a feature on this engine's vLLM.",
            description=f"{PROBE} found vLLM's classes different from its fingerprint for "
            "feature {{ $labels.feature }} and does not record it; the figures that feature "
            "feeds are missing or not exact for this engine.",
            dashboard=cfg.dashboards.blocks,
        ),
    ]


def ledger_alerts(cfg: Config) -> list[Rule]:
    q = Promql(cfg)
    return [
        alert(
            cfg,
            "KVScopeLedgerStale",
            # active: steps keep arriving (an idle engine sends no keyframe to repair it)
            f"{q.by_engine('max', q.m('kvscope_ledger_synced'))} == 0\nand\n"
            f"{q.by_engine('max', probe_state(q, 'active'))}"
            " == 1",
            severity="warning",
            for_=cfg.ledger_stale_for,
            summary="kvscope's view of a KV block pool has been stale for long although "
            "the probe keeps sending.",
            description=f"{LEDGER} has been out of sync for {cfg.ledger_stale_for} while "
            "its probe keeps sending: no keyframe has repaired it. Block gauges (free "
            "blocks, contiguity, tail waste) are absent, so the P1 alert cannot fire.",
            dashboard=cfg.dashboards.blocks,
        ),
        alert(
            cfg,
            "KVScopeLedgerMismatch",
            f"{q.increase('kvscope_ledger_mismatches_total', cfg.probe_problem_window)} > 0",
            severity="warning",
            summary="kvscope's rebuilt KV block pool disagreed with vLLM's free count or the "
            "probe's copy of the pool.",
            description=f"{LEDGER} had {{{{ $value | humanize }}}} self-check failure(s) in "
            f"the last {cfg.probe_problem_window} (vLLM's free block count at a step, or the "
            "probe's copy of the pool in a keyframe, differed from the replayed operations). "
            "Each mismatch marks the pool stale until the next keyframe; without dropped "
            "records it is a kvscope bug or a vLLM path the probe does not follow.",
            dashboard=cfg.dashboards.blocks,
        ),
        alert(
            cfg,
            "KVScopeAuditMismatch",
            f"{q.increase('kvscope_audit_mismatches_total', cfg.probe_problem_window)} > 0",
            severity="warning",
            summary="kvscope's figures for a KV block pool differ from vLLM's own pool.",
            description=f"{LEDGER} differed from vLLM's own BlockPool in "
            f"{{{{ $value | humanize }}}} audited block(s) or table(s) in the last "
            f"{cfg.probe_problem_window}. The audit reads vLLM's blocks, not the probe's copy: "
            "this vLLM changes its pool in a way the probe does not follow, so this engine's "
            "block figures are not exact until it stops.",
            dashboard=cfg.dashboards.blocks,
        ),
    ]


def sidecar_alerts(cfg: Config) -> list[Rule]:
    q = Promql(cfg)
    drift = q.m("kvscope_reconciliation_preemptions_diff")
    rw = cfg.reconciliation_window
    return [
        alert(
            cfg,
            "KVScopeProbeFramesRejected",
            q.increase(
                "kvscope_probe_frames_rejected_total",
                cfg.probe_problem_window,
                by=", ".join((*cfg.sidecar_labels, "reason")),
            )
            + " > 0",
            severity="warning",
            for_=cfg.frames_rejected_for,
            summary="The kvscope sidecar is refusing probe frames.",
            description=f"{SIDECAR} refused {{{{ $value | humanize }}}} probe frames in "
            f"the last {cfg.probe_problem_window} for reason {{{{ $labels.reason }}}}. "
            "'version' means a probe and a sidecar of different kvscope releases; the "
            "records in refused frames are lost.",
            dashboard=cfg.dashboards.blocks,
            per_engine=False,
        ),
        alert(
            cfg,
            "KVScopeSidecarDown",
            f"{q.m('up')} == 0",
            severity="warning",
            for_=cfg.sidecar_down_for,
            summary="Prometheus cannot scrape the kvscope sidecar.",
            description=f"Prometheus has failed to scrape {{{{ $labels.instance }}}} (job "
            f"{{{{ $labels.job }}}}) for {cfg.sidecar_down_for}: no kvscope metric and no "
            "kvscope alert for the engines it watches. vLLM itself is not affected.",
            dashboard=cfg.dashboards.blocks,
            per_engine=False,
        ),
        alert(
            cfg,
            "KVScopeSidecarCPUHigh",
            f"sum by ({', '.join(cfg.sidecar_labels)}) "
            f"(rate({q.m('kvscope_sidecar_cpu_seconds_total')}[{cfg.sidecar_cpu_window}]))"
            f" > {cfg.sidecar_cpu_cores:g}",
            severity="warning",
            for_=cfg.sidecar_cpu_window,
            summary="The kvscope sidecar uses far more CPU than it should.",
            description=f"{SIDECAR} used {{{{ printf \"%.2f\" $value }}}} cores on average over "
            f"the last {cfg.sidecar_cpu_window}, above {cfg.sidecar_cpu_cores:g} (eight busy "
            "engines cost it about a tenth of a core): on a host where vLLM's scheduler "
            "needs the CPU, kvscope competes with it. kvscope_sidecar_cpu_seconds_total "
            "says which thread.",
            dashboard=cfg.dashboards.blocks,
            per_engine=False,
        ),
        alert(
            cfg,
            "KVScopeReconciliationDrift",
            # One-sided: vLLM counts a preemption when its victim next emits a token (the
            # PREEMPTED event rides on that output, Scheduler.update_from_output) and never
            # for a victim aborted first, and the sidecar reads its count at the last
            # scrape: kvscope ahead is what sustained preemption looks like.
            f"max_over_time({drift}[{rw}]) < 0",
            severity="warning",
            summary="kvscope has counted fewer preemptions than vLLM for long.",
            description=f"For engine {ID} "
            "kvscope's preemption count minus vLLM's vllm:num_preemptions_total stayed at "
            f"{{{{ $value }}}} or below for {rw}: kvscope missed preemptions that vLLM "
            "counted (a probe off or dropping records for a while, or a sidecar restarted "
            "after vLLM). kvscope's count ahead of vLLM's is expected and does not fire "
            "this: vLLM counts a preemption only when its victim next emits a token, and "
            "never for a victim aborted before that.",
            dashboard=cfg.dashboards.blocks,
        ),
    ]


def sink_alerts(cfg: Config) -> list[Rule]:
    q = Promql(cfg)
    by = ", ".join((*cfg.sidecar_labels, "sink"))
    sw = cfg.sink_spool_window
    return [
        alert(
            cfg,
            "KVScopeSinkWriteErrors",
            f"sum by ({by}) (increase({q.m('kvscope_sink_errors_total')}[5m])) > 0",
            severity="warning",
            for_=cfg.sink_errors_for,
            summary="A kvscope sink keeps failing to write to its store.",
            description=f"{SINK} has failed to deliver or spool batches for "
            f"{cfg.sink_errors_for} ({{{{ $value | humanize }}}} errors in the last 5m). "
            "Prometheus metrics are unaffected; traces and decisions wait in the spool.",
            dashboard=cfg.dashboards.blocks,
            per_engine=False,
        ),
        alert(
            cfg,
            "KVScopeSinkSpoolGrowing",
            f"max by ({by}) (deriv({q.m('kvscope_sink_spool_bytes')}[{sw}])) > 0\nand\n"
            f"max by ({by}) ({q.m('kvscope_sink_oldest_unsent_age_seconds')})"
            f" > {cfg.sink_unsent_age_s}",
            severity="warning",
            for_=cfg.sink_spool_for,
            summary="A kvscope sink's disk spool keeps growing: its store is not keeping up.",
            description=f"{SINK} spools {{{{ $value | humanize1024 }}}}B/s more than it "
            f"delivers (over {sw}) and its oldest unsent row is older than "
            f"{cfg.sink_unsent_age_s} s. When the spool is full, rows are dropped.",
            dashboard=cfg.dashboards.blocks,
            per_engine=False,
        ),
        alert(
            cfg,
            # No `for`: a full spool under drop_oldest is flat (SpoolGrowing goes quiet just
            # as rows drop), a queue overflow records no error, a rejected batch is one error.
            "KVScopeSinkRowsDropped",
            f"sum by ({by}) (increase({q.m('kvscope_sink_rows_dropped_total')}"
            f"[{cfg.sink_dropped_window}])) > 0",
            severity="warning",
            summary="A kvscope sink dropped rows it will never deliver.",
            description=f"{SINK} dropped rows in the last {cfg.sink_dropped_window} "
            "(kvscope_sink_rows_dropped_total by table says which): a full spool, a queue "
            "overflow, a batch the store refused for good, or rows left in memory at "
            "shutdown. Those rows are missing from the store for good.",
            dashboard=cfg.dashboards.blocks,
            per_engine=False,
        ),
    ]


def health_alerts(cfg: Config) -> list[Rule]:
    return [*probe_alerts(cfg), *ledger_alerts(cfg), *sidecar_alerts(cfg), *sink_alerts(cfg)]
