"""The /ui page's "waiting head" card says what /api/layout's waiting_head says."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.browser.test_layout_ui import open_ui

pytestmark = [pytest.mark.twin, pytest.mark.browser]


def test_the_waiting_head_card_matches_the_api(serve: Any, page: Any) -> None:
    srv = serve(None)
    open_ui(page, f"{srv.url}/ui")
    (engine,) = httpx.get(f"{srv.url}/api/layout", timeout=5).json()["engines"]
    # The paused twin run (64 blocks, 104 waiting): r16 at the head needs 30 blocks, 21
    # are free (no --watermark: all of them free for it): it waits for blocks to free up,
    # and it would fit in the pool.
    assert engine["waiting_head"] == {"req_id": "r16", "blocks_needed": 30, "min_blocks": 30,
                                      "usable_blocks": 63, "never_fits": False,
                                      "admission_free": 21}
    assert engine["layout"]["summary"]["free_blocks"] == 21
    card = page.locator(".card", has=page.locator(".l", has_text="waiting head"))
    assert card.locator(".v").inner_text() == "waits for blocks"
    # one full-attention group: its bounds agree, and the card says one figure
    assert card.locator(".s").inner_text() == "r16 · needs 30 of 63 usable"
