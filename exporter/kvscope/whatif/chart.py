"""Bar charts of a ``kvscope whatif`` comparison, drawn with Pillow (no plotting library).

One panel per metric, one bar per setting in the same colour in every panel, a legend
naming the settings at the top. The image size depends only on the number of settings
(``size``), so a caller or a test knows it in advance.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image, ImageDraw, ImageFont

PANELS: list[tuple[str, str]] = [
    ("preemptions", "preemptions"),
    ("preemptions_priority", "preemptions, reason priority"),
    ("preemption_rate", "preemptions per request"),
    ("preempted_tokens", "computed tokens discarded"),
    ("recomputed_tokens", "recomputed tokens"),
    ("steps_to_drain", "steps to drain"),
    ("tail_waste_mean_tokens", "tail waste, mean tokens"),
    ("tail_waste_peak_tokens", "tail waste, peak tokens"),
    ("tail_waste_pct_of_allocated", "tail waste, % of allocated slots"),
    ("peak_used_pct", "peak used, % of usable blocks"),
    ("blocks_per_request", "blocks per request (peak held)"),
    ("mean_budget_utilization_pct", "mean budget utilization, %"),
]
COLUMNS = 3
PANEL_W, PANEL_H = 360, 220
TITLE_H, LEGEND_ROW_H, LEGEND_PER_ROW = 34, 20, 3
COLOURS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"]
INK, GRID, BACKGROUND = "#222222", "#cccccc", "#ffffff"


def size(n_settings: int) -> tuple[int, int]:
    """Width and height of the chart for ``n_settings`` settings."""
    legend = LEGEND_ROW_H * math.ceil(max(1, n_settings) / LEGEND_PER_ROW)
    rows = math.ceil(len(PANELS) / COLUMNS)
    return COLUMNS * PANEL_W, TITLE_H + legend + 8 + rows * PANEL_H


def _font(px: int) -> Any:
    try:
        return ImageFont.load_default(size=px)
    except (TypeError, ImportError, OSError):  # Pillow without FreeType: bitmap font
        return ImageFont.load_default()


def _fit(draw: ImageDraw.ImageDraw, text: str, font: Any, width: int) -> str:
    while text and draw.textlength(text, font=font) > width:
        text = text[:-2] + "…" if len(text) > 2 else ""
    return text


def _panel(draw: ImageDraw.ImageDraw, x0: int, y0: int, title: str,
           values: list[float], fonts: tuple[Any, Any]) -> None:
    title_font, value_font = fonts
    draw.text((x0 + 14, y0 + 8), title, fill=INK, font=title_font)
    base_y, top_y = y0 + PANEL_H - 22, y0 + 46
    left, right = x0 + 18, x0 + PANEL_W - 18
    draw.line([(left, base_y), (right, base_y)], fill=GRID, width=1)
    peak = max(values, default=0.0)
    slot = (right - left) / max(1, len(values))
    bar_w = max(4, int(slot * 0.6))
    for i, value in enumerate(values):
        cx = left + slot * (i + 0.5)
        height = 0 if peak <= 0 else round((base_y - top_y) * value / peak)
        colour = COLOURS[i % len(COLOURS)]
        if height > 0:
            draw.rectangle([cx - bar_w / 2, base_y - height, cx + bar_w / 2, base_y - 1],
                           fill=colour)
        label = str(value) if isinstance(value, int) else f"{value:.3g}"
        label = _fit(draw, label, value_font, int(slot) - 2)
        tw = draw.textlength(label, font=value_font)
        draw.text((cx - tw / 2, base_y - height - 16), label, fill=INK, font=value_font)


def draw(records: list[dict[str, Any]], subtitle: str) -> Image.Image:
    """The chart for ``records`` (``kvscope.whatif.report.record`` dicts)."""
    width, height = size(len(records))
    image = Image.new("RGB", (width, height), BACKGROUND)
    pen = ImageDraw.Draw(image)
    title_font, small = _font(15), _font(12)
    pen.text((14, 9), _fit(pen, f"kvscope whatif: {subtitle}", title_font, width - 28),
             fill=INK, font=title_font)
    entry_w = (width - 28) // LEGEND_PER_ROW
    for i, r in enumerate(records):
        x = 14 + (i % LEGEND_PER_ROW) * entry_w
        y = TITLE_H + (i // LEGEND_PER_ROW) * LEGEND_ROW_H
        pen.rectangle([x, y + 3, x + 12, y + 15], fill=COLOURS[i % len(COLOURS)])
        pen.text((x + 18, y + 2), _fit(pen, str(r["setting"]), small, entry_w - 24),
                 fill=INK, font=small)
    top = height - math.ceil(len(PANELS) / COLUMNS) * PANEL_H
    for n, (key, title) in enumerate(PANELS):
        x0, y0 = (n % COLUMNS) * PANEL_W, top + (n // COLUMNS) * PANEL_H
        pen.rectangle([x0 + 4, y0 + 4, x0 + PANEL_W - 4, y0 + PANEL_H - 4], outline=GRID)
        _panel(pen, x0, y0, title, [r[key] for r in records], (small, small))
    return image
