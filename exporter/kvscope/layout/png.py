"""A readable PNG of a layout dump: block ID across, one row per sample down, coloured by
state, with a title, axes and a legend. With several KV cache groups, a strip per group
under each engine shows which group holds each allocated block now.

Drawn with Pillow; a pool wider than the plot is shown at one pixel column per range of
blocks, coloured by the state most of those blocks had.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import numpy as np

from kvscope.layout import palette
from kvscope.layout.snapshot import STATE_NAMES

WIDTH = 1200
LEFT, RIGHT = 84, 24
TITLE_H = 58
HEAD_H = 44  # per engine: its subtitle
PLOT_H = 260
STRIP_H = 18  # per KV group, when there are several
AXIS_H = 42
LEGEND_H = 44
LEGEND_LABELS = ("free", "cached (free, evictable)", "allocated", "null")
SWATCH = 16
LEGEND_STEP = 230


def groups_of(engine: dict[str, Any]) -> int:
    n = len(engine.get("kv_groups") or [])
    return n if n > 1 else 0


def png_size(dump: dict[str, Any]) -> tuple[int, int]:
    body = sum(HEAD_H + PLOT_H + groups_of(e) * STRIP_H + AXIS_H for e in dump["engines"])
    return WIDTH, TITLE_H + max(body, PLOT_H) + LEGEND_H


def legend_swatches(height: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(state name, swatch box) of each legend entry in an image of this height."""
    y = height - LEGEND_H + (LEGEND_H - SWATCH) // 2
    return [(name, (LEFT + k * LEGEND_STEP, y, LEFT + k * LEGEND_STEP + SWATCH, y + SWATCH))
            for k, name in enumerate(STATE_NAMES)]


def states_of(snap: dict[str, Any]) -> np.ndarray:
    runs = np.asarray(snap["runs"], dtype=np.int64).reshape(-1, 4)
    return np.repeat(runs[:, 0], runs[:, 3]).astype(np.uint8)


def to_pixels(rows: list[np.ndarray], n: int, width: int, height: int) -> np.ndarray:
    """A (height, width) state matrix: majority state per block range, nearest sample."""
    m = np.full((len(rows), n), 255, np.uint8)
    for r, s in enumerate(rows):
        m[r, : min(n, s.size)] = s[:n]
    starts = (np.arange(width) * n) // width
    counts = np.stack([np.add.reduceat(m == s, starts, axis=1) for s in range(4)])
    cols = np.where(counts.max(axis=0) > 0, counts.argmax(axis=0), 255).astype(np.uint8)
    return cols[(np.arange(height) * len(rows)) // height]


def _lut() -> np.ndarray:
    lut = np.zeros((256, 3), np.uint8)
    lut[:] = palette.rgb(palette.PANEL)
    for k, name in enumerate(STATE_NAMES):
        lut[k] = palette.rgb(palette.STATE_COLORS[name])
    return lut


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _hms(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%H:%M:%S")


def render_png(dump: dict[str, Any], path: str) -> tuple[int, int]:
    from PIL import Image, ImageDraw, ImageFont

    size = png_size(dump)
    img = Image.new("RGB", size, palette.rgb(palette.BACKGROUND))
    d = ImageDraw.Draw(img)
    big, small = ImageFont.load_default(size=18), ImageFont.load_default(size=13)
    text, muted = palette.rgb(palette.TEXT), palette.rgb(palette.MUTED)
    engines = dump["engines"]
    names = ", ".join(f"engine {e['engine']} · model {e['model']}" for e in engines) or "no engine"
    d.text((LEFT, 12), f"kvscope KV block layout - {names}", font=big, fill=text)
    d.text((LEFT, 36), f"dumped {_utc(dump['taken_at'])} from {dump['source']}", font=small,
           fill=muted)
    lut, plot_w, y = _lut(), WIDTH - LEFT - RIGHT, TITLE_H
    for e in engines:
        y = _engine_panel(img, d, e, y, plot_w, lut, small)
    if not engines:
        d.text((LEFT, TITLE_H + PLOT_H // 2), "the sidecar knows no engine", font=small, fill=muted)
    for (name, box), label in zip(legend_swatches(size[1]), LEGEND_LABELS, strict=True):
        d.rectangle(box, fill=palette.rgb(palette.STATE_COLORS[name]))
        d.text((box[2] + 8, box[1]), label, font=small, fill=text)
    img.save(path, format="PNG")
    return size


def _engine_panel(img: Any, d: Any, e: dict[str, Any], y: int, plot_w: int,
                  lut: np.ndarray, font: Any) -> int:
    from PIL import Image

    text, muted = palette.rgb(palette.TEXT), palette.rgb(palette.MUTED)
    snaps = [s for s in e.get("timeline", {}).get("snapshots", []) if s.get("runs")]
    if not snaps and e.get("layout"):
        snaps = [e["layout"]]
    n = e["num_blocks"]
    cur = e.get("layout") or (snaps[-1] if snaps else None)
    line = f"engine {e['engine']} · {e['model']} · {n} blocks x {e['block_size']} tokens"
    if cur:
        s = cur["summary"]
        line += (f" · free {s['free_blocks']} (cached {s['cached_evictable_blocks']})"
                 f" · allocated {s['used_blocks']} · max contiguous free "
                 f"{s['max_contiguous_free_blocks']}")
    d.text((LEFT, y + 8), line, font=font, fill=text)
    span = (f"{len(snaps)} samples, {_utc(snaps[0]['ts'])} to {_hms(snaps[-1]['ts'])}"
            if snaps else f"no exact layout (ledger {e.get('status')})")
    d.text((LEFT, y + 25), span + " · one row per sample, newest at the bottom", font=font,
           fill=muted)
    top = y + HEAD_H
    if snaps:
        pix = to_pixels([states_of(s) for s in snaps], n, plot_w, PLOT_H)
        img.paste(Image.fromarray(lut[pix], "RGB"), (LEFT, top))
        if plot_w / n >= 6:  # small pools: a hairline between blocks
            for b in range(1, n):
                x = LEFT + b * plot_w // n
                d.line((x, top, x, top + PLOT_H - 1), fill=palette.rgb(palette.BACKGROUND))
        for frac, s in ((0.0, snaps[0]), (1.0, snaps[-1])):
            ty = top + int(frac * (PLOT_H - 14))
            d.text((LEFT - 8, ty), _hms(s["ts"]), font=font, fill=muted, anchor="ra")
    else:
        d.rectangle((LEFT, top, LEFT + plot_w - 1, top + PLOT_H - 1), outline=muted)
    bottom = top + PLOT_H
    if groups_of(e) and cur:
        _group_strips(img, d, e, cur, bottom, plot_w, lut, font)
        bottom += groups_of(e) * STRIP_H
    for b in sorted({(n - 1) * k // 4 for k in range(5)}):
        x = LEFT + int((b + 0.5) * plot_w / n)  # the middle of block b
        d.line((x, bottom, x, bottom + 4), fill=muted)
        d.text((x, bottom + 6), str(b), font=font, fill=muted, anchor="ma")
    d.text((LEFT + plot_w // 2, bottom + 24), "block ID", font=font, fill=muted, anchor="ma")
    return bottom + AXIS_H


def _group_strips(img: Any, d: Any, e: dict[str, Any], cur: dict[str, Any], y: int,
                  plot_w: int, lut: np.ndarray, font: Any) -> None:
    from PIL import Image

    runs = np.asarray(cur["runs"], dtype=np.int64).reshape(-1, 4)
    states = np.repeat(runs[:, 0], runs[:, 3]).astype(np.uint8)
    group = np.repeat(runs[:, 2], runs[:, 3])
    for g, kv in enumerate(e["kv_groups"]):
        mine = np.where((group == g) | (group < 0), states, 255).astype(np.uint8)
        pix = to_pixels([mine], e["num_blocks"], plot_w, STRIP_H - 4)
        img.paste(Image.fromarray(lut[pix], "RGB"), (LEFT, y + g * STRIP_H + 2))
        d.text((LEFT - 8, y + g * STRIP_H + 2), f"g{g} {kv['kind'][:10]}", font=font,
               fill=palette.rgb(palette.MUTED), anchor="ra")
