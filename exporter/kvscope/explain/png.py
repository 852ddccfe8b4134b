"""``kvscope explain --png``: the answer as one image for a ticket: the verdict, the
timeline as coloured spans, where the time went, and at each preemption the layout sample
with the request's blocks marked. Drawn with Pillow, in the layout views' colours."""

from __future__ import annotations

from typing import Any

from kvscope.explain.render_text import plural
from kvscope.layout import palette

WIDTH, LEFT = 1200, 20
BAR_H, STRIP_H, LINE_H = 26, 28, 18
SPAN_COLORS = {"waiting": "#5eb0ff", "running": "#3ecf8e", "preempted": "#ef476f"}
MINE = "#ffffff"
"""The request's own blocks on the layout strips: white stands out of every state colour."""
STATES = [palette.STATE_COLORS[k] for k in ("free", "cached", "allocated", "null")]


def png_height(answer: dict[str, Any]) -> int:
    h = 2 * LINE_H + 10
    for r in answer["engine_requests"]:
        h += 3 * LINE_H + BAR_H + 6 * LINE_H + 10
        h += sum(2 * LINE_H + (STRIP_H + 6 if p["layout"] else 0) for p in r["preemptions"])
    return h


def render_png(answer: dict[str, Any], path: str) -> tuple[int, int]:
    from PIL import Image, ImageDraw

    size = (WIDTH, png_height(answer))
    img = Image.new("RGB", size, palette.BACKGROUND)
    d = ImageDraw.Draw(img)
    d.text((LEFT, 8), f"kvscope explain {answer['request_id']}", fill=palette.TEXT)
    y = 8 + 2 * LINE_H
    for r in answer["engine_requests"]:
        y = _engine_request(d, r, y)
    img.save(path, "PNG")
    return size


def bar_x(ts: float, t0: float, t1: float) -> int:
    return LEFT + round((WIDTH - 2 * LEFT) * (ts - t0) / max(t1 - t0, 1e-9))


def _engine_request(d: Any, r: dict[str, Any], y: int) -> int:
    d.text((LEFT, y), f"engine request {r['request_id']} · {r['server'] or '-'} engine "
                      f"{r['engine']} · {r['model']}", fill=palette.TEXT)
    d.text((LEFT, y + LINE_H), r["verdict"], fill=palette.MUTED)
    y += 2 * LINE_H + 6
    ev = r["timeline"]
    t0, t1 = ev[0]["ts"], ev[-1]["ts"]
    for s in r["spans"]:
        d.rectangle((bar_x(s["from_ts"], t0, t1), y, max(bar_x(s["to_ts"], t0, t1) - 1,
                     bar_x(s["from_ts"], t0, t1)), y + BAR_H - 1), fill=SPAN_COLORS[s["state"]])
    y += BAR_H + LINE_H
    for k in ("waiting", "preempted", "recomputing", "running", "total") if r["lost"] else ():
        span = r["lost"][k]
        d.text((LEFT, y), f"{k:<12} {span['seconds']:>10.3f} s {span['steps']:>7} steps",
               fill=palette.TEXT)
        y += LINE_H
    y += LINE_H
    for i, p in enumerate(r["preemptions"], 1):
        y = _preemption(d, i, p, y)
    return y + 10


def _preemption(d: Any, i: int, p: dict[str, Any], y: int) -> int:
    trig = "itself" if p["requester_is_victim"] else (p["requester"] or "-")
    d.text((LEFT, y), f"preemption {i} at step {p['step']}: {p['reason']}, needed "
                      f"{plural(p['blocks_needed'], 'block')}, free {p['free_blocks']}, lost "
                      f"{plural(p['victim_blocks'], 'block')}; trigger {trig}",
           fill=palette.TEXT)
    h = p["holders"] or {"by_request": []}
    d.text((LEFT, y + LINE_H), "top holders: " + ", ".join(
        f"{x['key']} {x['blocks']}" for x in h["by_request"]), fill=palette.MUTED)
    y += 2 * LINE_H
    lay = p["layout"]
    if lay:
        strip_columns(d, lay, y)
        y += STRIP_H + 6
    return y


def strip_columns(d: Any, lay: dict[str, Any], y: int) -> None:
    """One column range per block (the pool across the width); the request's blocks white."""
    n, w = lay["num_blocks"], WIDTH - 2 * LEFT
    mine = set(lay["request_blocks"])
    for b in range(n):
        x0, x1 = LEFT + b * w // n, LEFT + (b + 1) * w // n - 1
        colour = MINE if b in mine else STATES[lay["states"][b]]
        d.rectangle((x0, y, max(x0, x1), y + STRIP_H - 1), fill=colour)
