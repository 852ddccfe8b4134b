"""Layer 3, layout: which blocks of one engine were free, cached, allocated or null over
time (ClickHouse layout_snapshots, via clickhouse/queries/layout_heatmap.sql), who held
them, and how scattered the free blocks were. The sidecar's /ui draws the same samples live.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import heatmap
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

from dashboards import clickhouse as sql
from dashboards import panels as p
from dashboards.blocks import engine_variables
from dashboards.config import Config
from dashboards.panels import ID

ENGINE = {"server": "${server:sqlstring}", "engine": "${engine:sqlstring}"}
"""One engine at a time (the heatmap needs one pool): no All on this dashboard."""
STATES = "0 free, 1 cached (free, evictable prefix-cache data), 2 allocated, 3 null"


def build(cfg: Config) -> p.Board:
    b = p.Board(cfg, cfg.uids.layout, "kvscope / Layout",
                "Block ID x time: free, cached, allocated and null KV blocks of one engine.")
    heat = sql.load("layout_heatmap").defaults
    b.variables(
        p.datasource("prometheus", "Prometheus"),
        p.datasource("clickhouse", "ClickHouse"),
        *engine_variables(cfg, all_=False),
        p.custom("block_bucket", "Blocks per cell", ["1", "2", "4", "8", "16", "32", "64"],
                 heat["block_bucket"], "Block IDs per heatmap cell (large pools: more)."),
        p.label_values("kv_group", "KV cache group",
                       f'vllm_scheduler_kv_group_request_blocks{{{cfg.job}, server=~"$server", '
                       f'engine=~"$engine"}}', all_value=heat["kv_group"],
                       description="The engine's KV cache groups as vLLM built them (a Gemma 3 "
                                   "of five sliding-window groups and one full one has six); "
                                   "All: every group; g: blocks of group g and the shared free "
                                   "ones."),
        p.custom("limit", "Rows", ["10", "20", "50"], sql.load("layout_owners").defaults["limit"],
                 "Rows of the holders table."),
    )
    matrix = [
        dm.DataTransformerConfig(id_val="groupingToMatrix", options={
            "columnField": "block", "rowField": "time", "valueField": "state",
            "emptyValue": "null"}),
        dm.DataTransformerConfig(id_val="convertFieldType", options={
            "conversions": [{"targetField": "time\\block", "destinationType": "time"}],
            "fields": {}}),
    ]
    cells = p.cells(
        "KV blocks of engine $server/$engine over time",
        f"Each cell is the state most samples had: {STATES}. Time buckets follow the "
        "panel's interval, blocks are grouped $block_bucket per cell. "
        "kvscope query layout_heatmap (and kvscope layout dump) give the same cells.",
        p.ch(sql.render("layout_heatmap", **ENGINE, block_bucket="${block_bucket}",
                        kv_group="${kv_group}")),
        transformations=matrix)
    cells.rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.GE).value("state"))
    b.row("Layout").add(cells)
    b.row("The pool at each sample").add(
        p.graph("Free, cached and used blocks (layout samples)",
                "From the same samples as the heatmap (layout_snapshots). Right axis: "
                "running and waiting requests.",
                p.ch(sql.render("layout_pool", **ENGINE), time_series=True),
                right="/running|waiting/"),
        p.grid("Largest holders at the last sample",
               "Running requests holding the most blocks at the last sample of the range, "
               "and in how many runs of consecutive IDs their blocks lie.",
               p.ch(sql.render("layout_owners", **ENGINE)), w=12, h=8),
        p.bars("Free runs by length (now)",
               "Runs of consecutive free block IDs no longer than each length (Prometheus).",
               p.prom(f"sum by (le) ({cfg.m('vllm_scheduler_free_block_runs')})", "≤ {{le}}",
                      instant=True)),
        p.graph("Longest free run vs free blocks (Prometheus)",
                "vLLM V1 takes any free blocks: a short run with enough free blocks never "
                "causes a preemption.",
                p.prom(cfg.m("vllm_scheduler_max_contiguous_free_blocks"),
                       ID + " max contiguous free"),
                p.prom(cfg.m("vllm_scheduler_free_blocks"), ID + " free")),
    )
    return b
