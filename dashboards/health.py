"""The blocks overview's "kvscope health" row: the probe and the ledger, the sinks, and the
reconciliation with vLLM's own /metrics. Everything is the sidecar's own series."""

from __future__ import annotations

from dashboards import panels as p
from dashboards.config import Config
from dashboards.panels import ID
from dashboards.promql import increase, rate


def probe_health(cfg: Config) -> list[p.Panel]:
    """kvscope's own health, probe side: connected, in sync, its cost, its records."""
    m = cfg.m
    return [
        p.graph("Probe connected and ledger in sync",
                "1 while the probe sent a record or a heartbeat within the health timeout "
                "(an idle engine stays connected); 1 while the "
                "rebuilt pool is exact (0 after a gap until the next keyframe).",
                p.prom(m("kvscope_probe_connected"), ID + " probe connected"),
                p.prom(m("kvscope_ledger_synced"), ID + " ledger synced"),
                w=8, minimum=0, maximum=1, step=True),
        p.graph("Seconds since the last probe record", "Per engine.",
                p.prom(m("kvscope_probe_last_record_age_seconds"), ID),
                unit="s", w=8),
        p.graph("Probe cost", "Time the probe spent on all its threads (engine-thread wall "
                "time, plus its sender's and libzmq's CPU) / time vLLM spent in schedule(); "
                "by thread: kvscope_probe_overhead_seconds_total{thread}.",
                p.prom(m("engine:kvscope_probe_overhead:ratio_rate5m"), ID),
                unit="percentunit", w=8),
        p.graph("Records received, dropped, rejected",
                "Probe records the receiver accepted; records the probe dropped rather than "
                "block vLLM; frames refused by reason.",
                p.prom(rate(cfg, "kvscope_probe_records_received_total", "job", engine=False),
                       "received"),
                p.prom(rate(cfg, "kvscope_probe_records_dropped_total"), ID + " dropped"),
                p.prom(rate(cfg, "kvscope_probe_frames_rejected_total", "reason", engine=False),
                       "rejected {{reason}}"),
                unit="ops"),
        p.graph("Ledger gaps, mismatches, audit, probe faults",
                "Should stay 0: gaps in the record sequence, failed self-checks of the "
                "ledger, blocks or tables that differed from vLLM's own pool when the audit "
                "read it, errors the probe contained inside vLLM.",
                p.prom(increase(cfg, "kvscope_ledger_gaps_total"), ID + " gaps"),
                p.prom(increase(cfg, "kvscope_ledger_mismatches_total"), ID + " mismatches"),
                p.prom(increase(cfg, "kvscope_audit_mismatches_total"), ID + " audit"),
                p.prom(increase(cfg, "kvscope_probe_faults_total"), ID + " faults")),
    ]


def sidecar_cost(cfg: Config) -> list[p.Panel]:
    """What the sidecar itself costs its host: CPU by thread, memory, CPU per engine step."""
    job = cfg.sel(engine=False)
    cpu = f"rate(kvscope_sidecar_cpu_seconds_total{job}[$__rate_interval])"
    steps = f"rate(vllm_scheduler_steps_total{job}[$__rate_interval])"
    return [
        p.graph("Sidecar CPU by thread",
                "CPU cores the kvscope sidecar process used, by thread: ingest (the probe's "
                "records into the ledger and rows), receiver (the sockets), layout (a "
                "sample of each pool a second), the sinks' batching and sending threads, "
                "main (the HTTP server), other (the embedded ClickHouse's own, libzmq's). "
                "Right axis: its resident memory.",
                p.prom(rate(cfg, "kvscope_sidecar_cpu_seconds_total", "instance, thread",
                            engine=False), "{{instance}} {{thread}}"),
                p.prom(cfg.on_sidecars(f"kvscope_sidecar_resident_memory_bytes{job}"),
                       "{{instance}} RSS"),
                right="/RSS/", right_unit="bytes"),
        p.graph("Sidecar CPU per engine step",
                "The sidecar's CPU (every thread) divided by the scheduler steps of all the "
                "engines it serves: what kvscope costs per engine step, whatever the step "
                "rate (benchmarks/README.md measures it at 256 running requests).",
                p.prom(cfg.on_sidecars(f"sum by (instance) ({cpu}) / sum by (instance) "
                                       f"({steps})"), "{{instance}}"),
                unit="s", minimum=0),
    ]


def sink_health(cfg: Config) -> list[p.Panel]:
    """The sinks: rows written, errors and drops, the spool."""
    job = cfg.sel(engine=False)
    return [
        p.graph("Sink rows written", "Rows each sink's store acknowledged, by table.",
                p.prom(rate(cfg, "kvscope_sink_rows_written_total", "sink, table", engine=False),
                       "{{sink}} {{table}}"),
                unit="rowsps", w=8),
        p.graph("Sink errors and dropped rows",
                "Failed attempts to spool or deliver a batch; rows given up.",
                p.prom(rate(cfg, "kvscope_sink_errors_total", "sink", engine=False),
                       "{{sink}} errors"),
                p.prom(rate(cfg, "kvscope_sink_rows_dropped_total", "sink, table", engine=False),
                       "{{sink}} {{table}} dropped"),
                unit="ops", w=8),
        p.graph("Sink spool", "Bytes waiting in the on-disk spool. Right axis: age of the "
                "oldest row the store has not acknowledged.",
                p.prom(cfg.on_sidecars(f"kvscope_sink_spool_bytes{job}"), "{{sink}} spool"),
                p.prom(cfg.on_sidecars(f"kvscope_sink_oldest_unsent_age_seconds{job}"),
                       "{{sink}} oldest age"),
                unit="bytes", w=8, right="/age/", right_unit="s"),
    ]


def vllm_health(cfg: Config) -> list[p.Panel]:
    """Reconciliation with vLLM's own /metrics, and the scrapes that feed it."""
    m = cfg.m
    return [
        p.graph("Reconciliation with vLLM's /metrics",
                "With kvscope serve --vllm-url: kvscope's preemptions minus vLLM's, and free "
                "blocks minus those derived from vllm:kv_cache_usage_perc; both return to 0 "
                "at rest. Under load vLLM's figures are those of its last scrape, and vLLM "
                "counts a preemption only when its victim next emits a token: the preemptions "
                "difference stays above 0 while victims wait, below 0 only when kvscope missed "
                "some. coarse = 1 for engines seen only through vLLM's /metrics.",
                p.prom(m("kvscope_reconciliation_preemptions_diff"), ID + " preemptions"),
                p.prom(m("kvscope_reconciliation_free_blocks_diff"), ID + " free blocks"),
                p.prom(m("kvscope_engine_coarse"), ID + " coarse")),
        p.graph("Scrapes of vLLM's /metrics", "With kvscope serve --vllm-url.",
                p.prom(rate(cfg, "kvscope_vllm_scrapes_total", "job", engine=False), "scrapes"),
                p.prom(rate(cfg, "kvscope_vllm_scrape_errors_total", "job", engine=False),
                       "errors"),
                unit="ops"),
    ]
