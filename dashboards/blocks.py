"""Layer 1, blocks overview: budget vs blocks, the pool, preemptions, tail waste, GPU, health.

The question it answers first: requests are preempted while the token budget looks idle,
is the KV block pool what ran out? Everything is Prometheus (the sidecar's /metrics and
the recording rules of alerts/kvscope.rules.yml).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from dashboards import panels as p
from dashboards.config import ENGINE_METRIC, Config
from dashboards.health import probe_health, sidecar_cost, sink_health, vllm_health
from dashboards.panels import ID
from dashboards.promql import rate


def engine_variables(cfg: Config, *, all_: bool = True,
                     all_servers: bool = False) -> list[db.QueryVariable]:
    """``$server``, ``$engine`` and ``$model``. A per-engine dashboard shows one server's
    engines at most (``all_servers`` False: no All for the server): on All of a thousand
    engines its panels drew 3,000 series and took Prometheus 2.4 s to evaluate
    (benchmarks/fleet_prometheus.py); the fleet dashboard, which reads the fleet rules,
    is the one for every engine at once."""
    series = f"{ENGINE_METRIC}{{{cfg.job}}}"
    return [
        p.label_values("server", "Server", series, all_=all_ and all_servers,
                       description="vLLM server: its API server's host:port, or "
                                   "KVSCOPE_SERVER."),
        p.label_values("engine", "Engine", series.replace("}", ', server=~"$server"}'),
                       all_=all_, description="vLLM's engine label: the data-parallel "
                                              "index, or KVSCOPE_ENGINE."),
        p.label_values("model", "Model", series.replace(
            "}", ', server=~"$server", engine=~"$engine"}'), description="Served model name."),
    ]


def build(cfg: Config) -> p.Board:
    b = p.Board(cfg, cfg.uids.blocks, "kvscope / Blocks overview",
                "Budget vs blocks: why vLLM preempts while the token budget looks idle.")
    b.variables(p.datasource("prometheus", "Prometheus"), *engine_variables(cfg))
    b.row("Now").add(*now(cfg))
    b.row("Budget vs blocks").add(budget_vs_blocks(cfg))
    b.row("Pool").add(*pool(cfg))
    b.row("Preemptions").add(*preemptions(cfg))
    b.row("Tail waste").add(*tail_waste(cfg))
    b.row("GPU and engine process").add(*gpu_and_engine_process(cfg))
    b.row("kvscope health").add(*probe_health(cfg), *sidecar_cost(cfg), *sink_health(cfg),
                                *vllm_health(cfg))
    return b


def now(cfg: Config) -> list[p.Panel]:
    """The figures to read first: free blocks, budget used, preemptions."""
    m, a = cfg.m, cfg.alerts
    return [
        p.single("Free KV blocks", "Free blocks now, summed over the selected engines' pools, "
                 "evictable prefix-cache blocks included (what allocation checks).",
                 p.prom(f"sum({m('vllm_scheduler_free_blocks')})")),
        p.single("Token budget used (5m)", "Scheduled tokens / token budget over 5 minutes, "
                 "each engine's exact (recording rule), averaged over the selected engines.",
                 p.prom(f"avg({m('engine:vllm_scheduler_token_budget_utilization:ratio_rate5m')})"),
                 unit="percentunit"),
        p.single("Preemptions in range", "Preemptions of running requests in the selected "
                 "time range, every reason.",
                 p.prom(f"sum(increase({m('vllm_scheduler_preempted_requests_total')}"
                        "[$__range]))"),
                 steps=[(None, "green"), (1, "orange")]),
        p.single("Preemptions per ended request (5m)", "Preemptions / requests that ended "
                 "over 5 minutes, the highest of the selected engines (a count per request: "
                 "it can pass 1); the alerts warn above "
                 f"{a.preemption_rate_warning:g} and page above {a.preemption_rate_critical:g}.",
                 p.prom("max("
                        f"{m('engine:vllm_scheduler_preemptions_per_request:ratio_rate5m')})"),
                 steps=[(None, "green"), (a.preemption_rate_warning,
                                            "orange"), (a.preemption_rate_critical, "red")]),
    ]


def budget_vs_blocks(cfg: Config) -> p.Panel:
    """The question first: is the budget idle while the blocks ran out?"""
    m = cfg.m
    return p.graph(
        "Token budget used vs free and longest free run",
        "Left axis: share of the per-step token budget (vLLM's max_num_scheduled_tokens: "
        "--max-num-batched-tokens unless --max-num-scheduled-tokens is set) that was "
        "scheduled. Right axis: free blocks and the longest run of consecutive free block "
        "IDs. Preemptions with the budget low and free blocks near 0 mean KV memory is the "
        "limit. vLLM V1 allocates any free blocks: a short contiguous run never causes a "
        "preemption by itself.",
        p.prom(m("vllm_scheduler_token_budget_utilization"), ID + " budget used (10 s)"),
        p.prom(m("engine:vllm_scheduler_token_budget_utilization:ratio_rate5m"),
               ID + " budget used (5m)"),
        p.prom(m("vllm_scheduler_free_blocks"), ID + " free blocks"),
        p.prom(m("vllm_scheduler_max_contiguous_free_blocks"), ID + " max contiguous free"),
        unit="percentunit", w=24, h=9, right="/free/", right_unit="short", minimum=0,
    )


def pool(cfg: Config) -> list[p.Panel]:
    """Where the blocks are: held, free, cached; what the queue head waits for."""
    m = cfg.m
    return [
        p.graph("Used, free and cached blocks",
                "The pool stacked: blocks held by requests, free blocks without data, and free "
                "blocks that still hold prefix-cache data (a prefix-cache hit takes one back; "
                "handing it to another request evicts its data).",
                p.prom(m("vllm_scheduler_used_blocks"), ID + " used"),
                p.prom(f"{m('vllm_scheduler_free_blocks')} - "
                       f"{m('vllm_scheduler_cached_evictable_blocks')}", ID + " free"),
                p.prom(m("vllm_scheduler_cached_evictable_blocks"), ID + " cached"),
                stack=True),
        p.graph("Head of the queue needs vs free",
                "Upper bound on the blocks the head of the waiting queue needs (its whole "
                "sequence in every KV cache group, before prefix-cache hits: loose on hybrid "
                "models) against the free blocks vLLM lets it take (less --watermark's "
                "reserve while requests run); while it truly needs more, admission is "
                "blocked (Decisions: Admissions blocked). Right axis: running and waiting "
                "requests.",
                p.prom(m("vllm_scheduler_waiting_head_blocks_needed"), ID + " head needs"),
                p.prom(m("vllm_scheduler_admission_free_blocks"), ID + " free for it"),
                p.prom(m("vllm_scheduler_running_requests"), ID + " requests running"),
                p.prom(m("vllm_scheduler_waiting_requests"), ID + " requests waiting"),
                right="/requests/"),
        p.bars("Free runs by length",
               "Runs of consecutive free block IDs no longer than each length (cumulative). "
               "Costs nothing to attention; multiplies descriptors for KV transfer.",
               p.prom(f"sum by (le) ({m('vllm_scheduler_free_block_runs')})", "≤ {{le}}",
                      instant=True)),
        p.graph("Block usage and token occupancy",
                "Used / usable blocks (vLLM's kv_cache_usage_perc), and filled / reserved "
                "token slots of the used blocks: the gap to 100% is tail waste.",
                p.prom(m("vllm_scheduler_kv_block_usage_ratio"), ID + " block usage"),
                p.prom(m("vllm_scheduler_kv_token_occupancy_ratio"),
                       ID + " token occupancy"),
                unit="percentunit", minimum=0, maximum=1),
    ]


def preemptions(cfg: Config) -> list[p.Panel]:
    """Preemptions by reason and per request; the work they threw away."""
    m, a = cfg.m, cfg.alerts
    return [
        p.graph("Preemptions by reason",
                "kv_full: the failed allocation needed more blocks than were free. priority: "
                "the same shortage, and the victim had a lower priority than the request that "
                "needed the blocks (the priority policy only picks the victim). unknown: "
                "nothing recorded explains it (never guessed).",
                p.prom(rate(cfg, "vllm_scheduler_preempted_requests_total",
                            "server, engine, reason"),
                       ID + " {{reason}}"),
                unit="ops"),
        p.graph("Preemptions per ended request",
                "Preemptions / requests that ended, over 5 minutes (the alerts' ratio and "
                "thresholds; a count per request: it can pass 1).",
                p.prom(m("engine:vllm_scheduler_preemptions_per_request:ratio_rate5m"),
                       ID),
                minimum=0,
                lines=[(a.preemption_rate_warning, "orange"),
                       (a.preemption_rate_critical, "red")]),
        p.graph("Tokens discarded and recomputed",
                "Computed tokens thrown away by preemptions, and those computed again on "
                "resume (prefix-cache hits excluded), per second.",
                p.prom(rate(cfg, "vllm_scheduler_preempted_tokens_total"),
                       ID + " discarded"),
                p.prom(rate(cfg, "vllm_scheduler_recomputed_tokens_total"),
                       ID + " recomputed"),
                unit="short"),
        p.graph("Requests arrived and ended",
                "Requests added to the scheduler, and those that left it by vLLM status.",
                p.prom(rate(cfg, "vllm_scheduler_requests_arrived_total"),
                       ID + " arrived"),
                p.prom(rate(cfg, "vllm_scheduler_requests_ended_total", "server, engine, status"),
                       ID + " {{status}}"),
                unit="reqps"),
    ]


def tail_waste(cfg: Config) -> list[p.Panel]:
    """Token slots reserved in the last blocks of requests but not filled."""
    m = cfg.m
    return [
        p.graph("Tail waste",
                "Token slots reserved but not filled in the last blocks of running requests.",
                p.prom(m("vllm_scheduler_tail_waste_tokens"), ID + " tokens")),
        p.graph("Tail waste per used block",
                "Unfilled token slots per block held; compare with the block size.",
                p.prom(f"{m('vllm_scheduler_tail_waste_tokens')} / "
                       f"({m('vllm_scheduler_used_blocks')} > 0)", ID)),
    ]


def gpu_and_engine_process(cfg: Config) -> list[p.Panel]:
    """The GPUs (NVML) and the EngineCore process on the sidecar's host."""
    m, gpu = cfg.m, cfg.sel(engine=False)
    return [
        p.graph("GPU memory",
                "NVML, per GPU of the sidecar's host. Absent without a GPU (the sidecar logs "
                "why once).",
                p.prom(cfg.on_sidecars(f"kvscope_gpu_memory_used_bytes{gpu}"),
                       "GPU {{gpu}} used"),
                p.prom(cfg.on_sidecars(f"kvscope_gpu_memory_total_bytes{gpu}"),
                       "GPU {{gpu}} total"),
                unit="bytes", w=8),
        p.graph("GPU utilization", "Busy fraction over NVML's last sample period.",
                p.prom(cfg.on_sidecars(f"kvscope_gpu_utilization_ratio{gpu}"),
                       "GPU {{gpu}} {{name}}"),
                unit="percentunit", w=8, minimum=0, maximum=1),
        p.graph("Engine process CPU and memory",
                "The EngineCore process, when it runs on the sidecar's host. Right axis: "
                "resident memory.",
                p.prom(f"rate({m('kvscope_engine_process_cpu_seconds_total')}"
                       "[$__rate_interval])", ID + " CPU cores"),
                p.prom(m("kvscope_engine_process_resident_memory_bytes"), ID + " RSS"),
                w=8, right="/RSS/", right_unit="bytes"),
    ]
