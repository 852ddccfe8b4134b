"""Small builders over grafana-foundation-sdk: one dashboard, its variables, its panels.

Every panel reads one datasource, given by a dashboard variable (``$prometheus``,
``$clickhouse``, ``$loki``), so the dashboards work with whatever UIDs a Grafana has.
Panels get stable IDs in the order they are added; targets get ref IDs A, B, C...
"""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    heatmap,
    logs,
    loki,
    prometheus,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import loki as lm
from grafana_foundation_sdk.models import prometheus as pm

from dashboards.clickhouse import DATASOURCE as CLICKHOUSE
from dashboards.clickhouse import ClickHouse
from dashboards.config import CLICKHOUSE_TYPE, Config

ID = "{{server}}/{{engine}}"
"""Legend of a per-engine series: its identity, as the sidecar's engine key reads."""
PROMETHEUS = dm.DataSourceRef(type_val="prometheus", uid="${prometheus}")
LOKI = dm.DataSourceRef(type_val="loki", uid="${loki}")
DATASOURCE_TYPES = {"prometheus": "prometheus", "clickhouse": CLICKHOUSE_TYPE, "loki": "loki"}

Query = cogbuilder.Builder[Any]
Panel = cogbuilder.Builder[dm.Panel]


# -- dashboard ---------------------------------------------------------------------------
class Board:
    """A dashboard under construction: rows, panels with stable IDs, links to the others."""

    def __init__(self, cfg: Config, uid: str, title: str, description: str) -> None:
        self.next_id = 1
        self.dash = (
            db.Dashboard(title).uid(uid).description(description).tags(list(cfg.tags))
            .refresh(cfg.refresh).time(cfg.time_from, "now").timezone("browser")
            .tooltip(dm.DashboardCursorSync.CROSSHAIR).editable()
            .link(db.DashboardLink("kvscope").type(dm.DashboardLinkType.DASHBOARDS)
                  .tags(list(cfg.tags)).as_dropdown(False).include_vars(True)
                  .keep_time(True))
        )

    def variables(self, *variables: cogbuilder.Builder[dm.VariableModel]) -> Board:
        for v in variables:
            self.dash.with_variable(v)
        return self

    def row(self, title: str) -> Board:
        self.dash.with_row(db.Row(title).id(self._id()))
        return self

    def add(self, *panels: Any) -> Board:
        for p in panels:
            self.dash.with_panel(p.id(self._id()))
        return self

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def build(self) -> dm.Dashboard:
        return self.dash.build()


# -- variables ---------------------------------------------------------------------------
def datasource(name: str, label: str) -> db.DatasourceVariable:
    return db.DatasourceVariable(name).label(label).type(DATASOURCE_TYPES[name])


def label_values(name: str, label: str, series: str, *, all_: bool = True,
                 description: str = "", all_value: str = ".*") -> db.QueryVariable:
    """A Prometheus label's values; with All, the All value is ``all_value`` (``.*``, for
    ``=~``)."""
    v = (db.QueryVariable(name).label(label).datasource(PROMETHEUS)
         .query(f"label_values({series}, {name})")
         .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
         .sort(dm.VariableSort.NATURAL_ASC).include_all(all_))
    if all_:
        v.all_value(all_value).current(dm.VariableOption(text="All", value="$__all",
                                                         selected=True))
    if description:
        v.description(description)
    return v


def custom(name: str, label: str, values: list[str], default: str,
           description: str = "") -> db.CustomVariable:
    if default not in values:
        raise ValueError(f"variable {name}: default {default!r} is not one of {values}")
    return (db.CustomVariable(name).label(label).values(",".join(values))
            .current(dm.VariableOption(text=default, value=default, selected=True))
            .description(description))


def textbox(name: str, label: str, description: str,
            default: str = "") -> db.TextBoxVariable:
    v = db.TextBoxVariable(name).label(label).description(description)
    return v.default_value(default) if default else v


# -- queries -----------------------------------------------------------------------------
def prom(expr: str, legend: str = "", *, instant: bool = False) -> prometheus.Dataquery:
    q = (prometheus.Dataquery().expr(expr).datasource(PROMETHEUS)
         .editor_mode(pm.QueryEditorMode.CODE))
    if legend:
        q.legend_format(legend)
    return q.instant() if instant else q.range()


def loki_q(expr: str, legend: str = "", *, instant: bool = False) -> loki.Dataquery:
    q = (loki.Dataquery().expr(expr).datasource(LOKI)
         .query_type(lm.LokiQueryType.INSTANT if instant else lm.LokiQueryType.RANGE))
    if legend:
        q.legend_format(legend)
    return q


def ch(sql: str, *, time_series: bool = False) -> ClickHouse:
    q = ClickHouse(sql)
    return q.time_series() if time_series else q


def _ds(q: Query) -> dm.DataSourceRef:
    if isinstance(q, ClickHouse):
        return CLICKHOUSE
    return LOKI if isinstance(q, loki.Dataquery) else PROMETHEUS


def _common(p: Any, title: str, description: str, queries: tuple[Query, ...],
            w: int, h: int, unit: str | None) -> Any:
    p.title(title).description(description).span(w).height(h).datasource(_ds(queries[0]))
    for i, q in enumerate(queries):
        p.with_target(q.ref_id(chr(ord("A") + i)))
    if unit:
        p.unit(unit)
    return p


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=v, color=c) for v, c in steps])


# -- panels ------------------------------------------------------------------------------
def graph(title: str, description: str, *queries: Query, unit: str = "short", w: int = 12,
          h: int = 8, stack: bool = False, right: str | None = None,
          right_unit: str | None = None, lines: list[tuple[float, str]] | None = None,
          minimum: float | None = None, maximum: float | None = None,
          step: bool = False) -> timeseries.Panel:
    """A time series; ``right`` is a regexp of series drawn on a right-hand axis."""
    p = _common(timeseries.Panel(), title, description, queries, w, h, unit)
    p.line_width(1).fill_opacity(30 if stack else 8).show_points(cm.VisibilityMode.NEVER)
    p.legend(cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.LIST)
             .placement(cm.LegendPlacement.BOTTOM).show_legend(True))
    p.tooltip(cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI)
              .sort(cm.SortOrder.DESCENDING))
    if step:
        p.line_interpolation(cm.LineInterpolation.STEP_AFTER)
    if stack:
        p.stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL))
    if minimum is not None:
        p.min(minimum)
    if maximum is not None:
        p.max(maximum)
    if right:
        props = [dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right")]
        if right_unit:
            props.append(dm.DynamicConfigValue(id_val="unit", value=right_unit))
        p.override_by_regexp(right, props)
    if lines:
        p.thresholds(thresholds((None, "transparent"), *lines))
        p.thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED))
    return p


def single(title: str, description: str, query: Query, *, unit: str = "short", w: int = 6,
           h: int = 4, steps: list[tuple[float | None, str]] | None = None) -> stat.Panel:
    p = _common(stat.Panel(), title, description, (query,), w, h, unit)
    p.graph_mode(cm.BigValueGraphMode.AREA).color_mode(cm.BigValueColorMode.VALUE)
    p.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    p.thresholds(thresholds(*(steps or [(None, "green")])))
    return p


def grid(title: str, description: str, query: Query, *, w: int = 24, h: int = 9,
         links: dict[str, tuple[str, str] | list[tuple[str, str]]] | None = None,
         units: dict[str, str] | None = None) -> table.Panel:
    """A table; ``links`` maps a column to (link title, URL) data links, one or a list."""
    p = _common(table.Panel(), title, description, (query,), w, h, None)
    p.cell_height(cm.TableCellHeight.SM).filterable(True)
    for column, given in (links or {}).items():
        pairs = given if isinstance(given, list) else [given]
        p.override_by_name(column, [dm.DynamicConfigValue(
            id_val="links", value=[{"title": text, "url": url} for text, url in pairs])])
    for column, unit in (units or {}).items():
        p.override_by_name(column, [dm.DynamicConfigValue(id_val="unit", value=unit)])
    return p


def bars(title: str, description: str, query: Query, *, w: int = 12, h: int = 8,
         unit: str = "short") -> bargauge.Panel:
    p = _common(bargauge.Panel(), title, description, (query,), w, h, unit)
    p.display_mode(cm.BarGaugeDisplayMode.GRADIENT).orientation(cm.VizOrientation.HORIZONTAL)
    p.reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    return p


def loglines(title: str, description: str, query: Query, *, w: int = 24,
             h: int = 10) -> logs.Panel:
    p = _common(logs.Panel(), title, description, (query,), w, h, None)
    return (p.show_time(True).wrap_log_message(True).enable_log_details(True)
            .sort_order(cm.LogsSortOrder.DESCENDING).prettify_log_message(False))


def cells(title: str, description: str, query: Query, *, w: int = 24, h: int = 14,
          transformations: list[dm.DataTransformerConfig] | None = None,
          lowest: float = 0, highest: float = 3) -> heatmap.Panel:
    """A heatmap of precomputed cells (no bucketing by Grafana), values as colours."""
    p = _common(heatmap.Panel(), title, description, (query,), w, h, None)
    # Grafana hides cells <= 1e-9 by default, which would hide every 0 (free) cell.
    p.calculate(False).cell_gap(0).show_value(cm.VisibilityMode.NEVER)
    p.filter_values(heatmap.FilterValueRange().le(lowest - 1))
    p.color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Spectral")
            .reverse(True).fill("dark-orange").scale(hm.HeatmapColorScale.LINEAR)
            .exponent(0.5).steps(4).min(lowest).max(highest))
    p.y_axis(heatmap.YAxisConfig().unit("none").decimals(0).axis_label("block ID"))
    p.show_legend()
    for t in transformations or []:
        p.with_transformation(t)
    return p
