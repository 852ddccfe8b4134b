"""The fleet: every engine at once, read from the ``kvscope-fleet`` recording rules.

Fleet-wide and per-model panels read the few ``fleet:`` / ``model:`` series; the top lists
rank the ``engine:`` series, and each row links to that engine's own dashboard and names the
``kvscope explain --worst`` command for it. One panel reads a raw per-engine family over a
range (the audit's mismatches, ``increase`` over an hour: three series an engine), two read
raw families at one instant (features off, probe states); the rest read recording rules.
"""

from __future__ import annotations

from grafana_foundation_sdk.models import prometheus as pm

from dashboards import panels as p
from dashboards.blocks import engine_variables
from dashboards.config import Config

MODEL = 'model=~"$model"'
EXPLAIN_DOCS = "https://github.com/kvscope/kvscope/blob/main/README.md#kvscope-explain"
BUCKETS = ((None, 0.05), (0.05, 0.2), (0.2, 0.5), (0.5, None))
"""Free-fraction bands of the distribution panel (the first is the P1 alert's)."""


def build(cfg: Config) -> p.Board:
    b = p.Board(cfg, cfg.uids.fleet, "kvscope / Fleet",
                "Every engine at once: the fleet's pool, its worst engines, its silent probes.")
    b.variables(p.datasource("prometheus", "Prometheus"),
                *engine_variables(cfg, all_servers=True),
                p.custom("top", "Top", ["5", "10", "20", "50"], "10",
                         "Rows of the top lists."))
    b.row("Fleet now").add(*now(cfg))
    b.row("By model").add(*by_model(cfg))
    b.row("Worst engines").add(*worst(cfg))
    b.row("Probes").add(*probes(cfg))
    return b


def now(cfg: Config) -> list[p.Panel]:
    return [
        p.single("Fleet free fraction", "Free blocks over usable blocks, all engines summed.",
                 p.prom("fleet:vllm_scheduler_free_blocks:ratio"), unit="percentunit",
                 steps=[(None, "red"), (cfg.alerts.exhausted_free_ratio, "green")]),
        p.single("Fleet preemptions", "Preemptions per second, all engines.",
                 p.prom("fleet:vllm_scheduler_preemptions:rate5m"), unit="ops"),
        p.single("Fleet tail waste", "Unfilled token slots of used blocks, all engines.",
                 p.prom("fleet:vllm_scheduler_tail_waste:ratio"), unit="percentunit"),
        p.single("Engines whose head never fits",
                 "Engines whose waiting head needs more blocks than their whole pool.",
                 p.prom("fleet:vllm_scheduler_waiting_head_never_fits:sum"),
                 steps=[(None, "green"), (1, "red")]),
    ]


def _band(lo: float | None, hi: float | None) -> tuple[str, str]:
    x = 'engine:vllm_scheduler_free_blocks:ratio{model=~"$model"}'
    expr = x + (f" > {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
    label = (f"<= {hi:.0%}" if lo is None else f"> {lo:.0%}" if hi is None
             else f"{lo:.0%} - {hi:.0%}")
    return f"count({expr}) or vector(0)", label


def by_model(cfg: Config) -> list[p.Panel]:
    return [
        p.graph("Engines by free fraction",
                "How many engines have each share of their pool free (stacked): the fleet's "
                "free-fraction distribution over time.",
                *(p.prom(*_band(lo, hi)) for lo, hi in BUCKETS), stack=True, w=8),
        p.graph("Free fraction by model", "Free over usable blocks, each model's engines summed.",
                p.prom(f"model:vllm_scheduler_free_blocks:ratio{{{MODEL}}}", "{{model}}"),
                unit="percentunit", minimum=0, maximum=1, w=8),
        p.graph("Preemptions by model and reason", "Per second.",
                p.prom(f"model_reason:vllm_scheduler_preemptions:rate5m{{{MODEL}}}",
                       "{{model}} {{reason}}"), unit="ops", w=8),
        p.graph("Tail waste by model", "Unfilled token slots of used blocks.",
                p.prom(f"model:vllm_scheduler_tail_waste:ratio{{{MODEL}}}", "{{model}}"),
                unit="percentunit", minimum=0, w=12),
        p.graph("Tokens recomputed after preemption, by model",
                "Share of scheduled tokens spent computing again what preemptions discarded "
                "(tokens, not time: recomputing is prefill).",
                p.prom(f"model:vllm_scheduler_recomputed_tokens:ratio_rate5m{{{MODEL}}}",
                       "{{model}}"), unit="percentunit", minimum=0, w=12),
    ]


def table(expr: str) -> p.Query:
    """An instant query as a table: one row per series, a column per label."""
    return p.prom(expr, instant=True).format(pm.PromQueryFormat.TABLE)


def _top(cfg: Config, title: str, description: str, series: str, unit: str) -> p.Panel:
    sel = '{server=~"$server", engine=~"$engine", model=~"$model"}'
    engine_url = (f"/d/{cfg.uids.blocks}?var-server=${{__data.fields.server}}"
                  "&var-engine=${__data.fields.engine}&${__url_time_range}")
    explain = ("kvscope explain --worst 10 --since 900 --server ${__data.fields.server} "
               "--engine ${__data.fields.engine}")
    return p.grid(title, description + " Click an engine for its dashboard, its server for "
                  "the kvscope explain --worst command to run against it.",
                  table(f"topk($top, {series}{sel})"), w=12, h=9,
                  links={"engine": ("Blocks overview of this engine", engine_url),
                         "server": (explain, EXPLAIN_DOCS)},
                  units={"Value": unit})


def worst(cfg: Config) -> list[p.Panel]:
    return [
        _top(cfg, "Top engines by preemption rate", "Preemptions per second over 5 minutes.",
             "engine:vllm_scheduler_preemptions:rate5m", "ops"),
        _top(cfg, "Top engines by tokens recomputed",
             "Share of the engine's scheduled tokens spent recomputing preempted work.",
             "engine:vllm_scheduler_recomputed_tokens:ratio_rate5m", "percentunit"),
    ]


def probes(cfg: Config) -> list[p.Panel]:
    state = cfg.m("kvscope_probe_state", 'state=~"silent|gone"')
    # hash_field is only a faster read: nothing is lost without it (as the alert reads it)
    disabled = cfg.m("kvscope_probe_feature_disabled", 'feature!="hash_field"')
    audit = cfg.m("kvscope_audit_mismatches_total")
    links = {"engine": ("Blocks overview of this engine",
                        f"/d/{cfg.uids.blocks}?var-server=${{__data.fields.server}}"
                        "&var-engine=${__data.fields.engine}")}
    return [
        p.grid("Engines whose probe does not record a feature",
               "The probe found this engine's vLLM different from its fingerprint for the "
               "feature and does not record it (KVScopeProbeFeatureDisabled).",
               table(f"max by (server, engine, model, feature) ({disabled}) == 1"),
               w=12, h=8, links=links),
        p.grid("Engines whose figures differ from vLLM's pool",
               "Blocks or tables the audit found different from vLLM's own pool in the last "
               "hour, by kind (KVScopeAuditMismatch): these engines' block figures are not "
               "exact.",
               table(f"sum by (server, engine, model, kind) (increase({audit}[1h])) > 0"),
               w=12, h=8, links=links),
        p.graph("Engines by probe state", "active: stepping; idle: heartbeats only; silent: "
                "nothing within the health timeout; gone: the engine process exited.",
                p.prom("fleet_state:kvscope_probe_state:sum", "{{state}}"), stack=True),
        p.grid("Engines whose probe is silent or gone",
               "Their block figures are stale or absent; the engine's dashboard says since "
               "when.", table(f"max by (server, engine, model, state) ({state}) == 1"),
               w=12, h=8,
               links={"engine": ("Blocks overview of this engine",
                                 f"/d/{cfg.uids.blocks}?var-server=${{__data.fields.server}}"
                                 "&var-engine=${__data.fields.engine}")}),
    ]
