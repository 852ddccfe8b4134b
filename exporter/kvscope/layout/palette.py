"""Colours of the layout views: the /ui page (ui/index.html keeps a copy, checked by the
browser test) and the PNG of ``kvscope layout dump``. Chosen for a dark background:
free and cached blocks stay cool and dim, allocated ones warm and bright."""

from __future__ import annotations

BACKGROUND = "#0b0f14"
PANEL = "#11171f"
TEXT = "#d8e0e8"
MUTED = "#8394a5"

STATE_COLORS = {
    "free": "#26384f",
    "cached": "#237a70",
    "allocated": "#f0a03c",
    "null": "#5a636e",
}
"""By state name (``layout_snapshot.STATE_NAMES``); ``allocated`` when not coloured by owner."""

UNOWNED = "#dfe4ea"
"""An allocated block no running request lists (for example a KV transfer in flight)."""

OWNER_PALETTE = (
    "#f4a259", "#ef476f", "#f6c945", "#c77dff", "#ff8fab",
    "#e76f51", "#b5e48c", "#9d8cff", "#ffd6a5", "#4cc9f0",
)


def fnv1a(text: str) -> int:
    """32-bit FNV-1a of the UTF-8 bytes (the page computes the same)."""
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def owner_color(req_id: str) -> str:
    """A request keeps its colour from one sample to the next."""
    return OWNER_PALETTE[fnv1a(req_id) % len(OWNER_PALETTE)]


def rgb(color: str) -> tuple[int, int, int]:
    c = color.lstrip("#")
    return int(c[0:2], 16), int(c[2:4], 16), int(c[4:6], 16)
