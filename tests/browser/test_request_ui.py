"""``/ui/requests/{id}`` in headless Chromium and ``/api/requests/{id}``, served by a
sidecar app from a chDB store a twin run filled (``request_store``, its own process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from kvscope.explain import render_json
from kvscope.localvllm.server import free_port
from tests.browser.conftest import ARTIFACTS

pytestmark = [pytest.mark.twin, pytest.mark.browser]
ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": "Bearer t0ken"}


@pytest.fixture(scope="module")
def store_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    port = free_port()
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
    proc = subprocess.Popen([sys.executable, "-m", "tests.browser.request_store",
                             str(tmp_path_factory.mktemp("store")), str(port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, f"request_store exited {proc.poll()}"
        yield {**json.loads(line), "url": f"http://127.0.0.1:{port}"}
    finally:
        proc.terminate()
        proc.wait(20)


def test_api_answers_the_schema_404s_unknown_and_needs_the_token(store_app: dict) -> None:
    url, rid = store_app["url"], store_app["preempted"]
    assert httpx.get(f"{url}/api/requests/{rid}", timeout=30).status_code == 401
    r = httpx.get(f"{url}/api/requests/{rid}", headers=AUTH, timeout=30)
    assert r.status_code == 200
    body = r.json()
    jsonschema.validate(body, render_json.schema())
    (er,) = body["engine_requests"]
    assert len(er["preemptions"]) == store_app["preempt_count"] > 0
    assert any(p["layout"] and p["layout"]["request_blocks"] for p in er["preemptions"])
    miss = httpx.get(f"{url}/api/requests/nope", headers=AUTH, timeout=30)
    assert miss.status_code == 404 and "no request 'nope'" in miss.json()["detail"]


def test_page_draws_the_timeline_and_marks_its_blocks(store_app: dict, page: Any) -> None:
    url, rid = store_app["url"], store_app["preempted"]
    body = httpx.get(f"{url}/api/requests/{rid}", headers=AUTH, timeout=30).json()
    (er,) = body["engine_requests"]
    page.goto(f"{url}/ui/requests/{rid}?token=t0ken")
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    assert page.locator("#rid").inner_text() == rid
    assert page.locator(".preemption").count() == len(er["preemptions"])
    states = page.locator("#timeline rect.span").evaluate_all(
        "els => els.map(e => e.dataset.state)")
    assert states.count("preempted") == len(er["preemptions"])
    assert states[0] == ("waiting" if er["lost"]["waiting"]["seconds"] > 0 else "running")
    for k in ("waiting", "preempted", "total"):
        cell = page.locator(f"tr.lost[data-k='{k}'] td").nth(2).inner_text()
        assert cell == f"{er['lost'][k]['steps']} steps"
    # while it waited: what the text answer says, whether it could fit and against what
    w = er["waiting"]
    assert w is not None and w["could_fit"]["fits"]
    fit = w["could_fit"]
    waited = " ".join(page.locator(".waited").inner_text().split())
    decisions = ("1 admission_blocked decision names it" if w["admission_blocked"] == 1 else
                 f"{w['admission_blocked']} admission_blocked decisions name it")
    why = ", ".join(f"{r} {k}" for r, k in sorted(w["admission_blocked_reasons"].items()))
    assert w["admission_blocked"] > 0 and why  # this request waited behind blocked heads
    assert waited.startswith(f"while it waited (step {w['step']}): {decisions} ({why}); "
                             "it could fit the pool "
                             f"({fit['required_blocks']} blocks at its full length, of "
                             f"{fit['usable_blocks']} usable) held as the step began: "
                             f"{w['holders']['held_blocks']} blocks")
    # each figure said as what it is: the holders' block tables summed (shared prefix
    # blocks in each), the evictable cached blocks dated by the layout sample they are from
    for panel, p in zip(page.locator(".preemption").all(), er["preemptions"], strict=True):
        text = " ".join(panel.inner_text().split())
        h = p["holders"]
        assert (f"held as the step began: {h['held_blocks']} blocks in {h['requests']} "
                "requests' block tables") in text
        assert (f"{p['cached_evictable_blocks']} evictable cached in the layout sample of step "
                f"{p['layout']['step']}" if p["layout"] else
                "no layout sample at or before it") in text
    # the first preemption with a sample: the marked pixels are exactly its blocks
    i, p = next((i, p) for i, p in enumerate(q for q in er["preemptions"] if q["layout"])
                if p["layout"]["request_blocks"])
    red = page.locator("canvas.layout").nth(i).evaluate(
        """c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                  const out = []; for (let k = 0; k < d.length / 4; k++)
                  if (d[4*k] === 0xef && d[4*k+1] === 0x47 && d[4*k+2] === 0x6f) out.push(k);
                  return out; }""")
    assert red == p["layout"]["request_blocks"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "request.png"), full_page=True)


def test_page_says_never_preempted_and_unknown(store_app: dict, page: Any) -> None:
    url = store_app["url"]
    page.goto(f"{url}/ui/requests/{store_app['calm']}?token=t0ken")
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    assert page.locator("p.never").inner_text() == "never preempted"
    page.goto(f"{url}/ui/requests/nope?token=t0ken")
    page.wait_for_selector("#error", timeout=30_000)
    assert "no request 'nope'" in page.locator("#error").inner_text()


def test_png_marks_its_blocks_on_each_layout_strip(store_app: dict, tmp_path: Path) -> None:
    from PIL import Image, ImageColor

    from kvscope.explain import png

    body = httpx.get(f"{store_app['url']}/api/requests/{store_app['preempted']}",
                     headers=AUTH, timeout=30).json()
    path = tmp_path / "r.png"
    size = png.render_png(body, str(path))
    img = Image.open(path).convert("RGB")
    assert img.size == size == (png.WIDTH, png.png_height(body))
    (er,) = body["engine_requests"]
    marked = [p["layout"] for p in er["preemptions"] if p["layout"]]
    strip = {ImageColor.getrgb(c) for c in [*png.STATES, png.MINE]}
    w = png.WIDTH - 2 * png.LEFT
    rows, prev = [], False
    for y in range(img.size[1]):  # a strip's rows hold only state colours and white
        row = [img.getpixel((x, y)) for x in range(png.LEFT, png.LEFT + w)]
        is_strip = all(px in strip for px in row)
        if is_strip and not prev:
            rows.append(row)
        prev = is_strip
    assert len(rows) == len(marked) > 0
    for row, lay in zip(rows, marked, strict=True):
        n = lay["num_blocks"]
        white = sorted({b for b in range(n) if row[b * w // n] == (255, 255, 255)})
        assert white == lay["request_blocks"]
