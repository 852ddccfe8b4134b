"""``kvscope layout dump`` against a real sidecar app on a free port: JSON that validates,
a PNG of the expected size with its legend, and ``--pid`` finding the right sidecar."""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import uvicorn
from fastapi import FastAPI
from PIL import Image
from prometheus_client import CollectorRegistry

from kvscope.layout import dump as layout_dump
from kvscope.layout import palette
from kvscope.layout import png as layout_png
from kvscope.layout.api import layout_router
from kvscope.layout.sampler import LayoutSampler
from kvscope.localvllm.server import free_port
from kvscope.sidecar.http.app import create_app
from tests.unit.test_layout import C, F, N, U, pool
from tests.unit.test_layout_api import SCHEMA


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a thread at a free 127.0.0.1 port."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def sidecar() -> Iterator[str]:
    hub = pool([N, U, U, F, U, U, C, C, F, U], {"a": [[1, 2, 9]], "b": [[4, 5]]},
               {"a": 40, "b": 20})
    sampler = LayoutSampler(hub)
    now = time.time()
    for k in range(5):
        sampler.tick(now=now - 5 + k)
    app = create_app(hub, CollectorRegistry(), health_timeout_s=30, token="tk")
    app.include_router(layout_router(hub, sampler))
    with serving(app) as url:
        yield url


def dump(*argv: str) -> int:
    return layout_dump.main(["layout", "dump", *argv])


def test_dump_writes_schema_valid_json_and_a_png_with_a_legend(
    sidecar: str, tmp_path: Path
) -> None:
    out, png = tmp_path / "layout.json", tmp_path / "layout.png"
    assert dump("--output", str(out), "--png", str(png), "--url", sidecar, "--token", "tk") == 0
    body = json.loads(out.read_text())
    jsonschema.validate(body, SCHEMA)
    (e,) = body["engines"]
    assert len(e["timeline"]["snapshots"]) == 5 and e["layout"]["blocks_covered"] == 10

    img = Image.open(png)
    img.load()
    assert img.format == "PNG" and img.size == layout_png.png_size(body) == (1200, 448)
    rgb = img.convert("RGB")
    for name, (x0, y0, x1, y1) in layout_png.legend_swatches(img.size[1]):
        assert rgb.getpixel(((x0 + x1) // 2, (y0 + y1) // 2)) == palette.rgb(
            palette.STATE_COLORS[name])
    top = layout_png.TITLE_H + layout_png.HEAD_H
    plot_w = layout_png.WIDTH - layout_png.LEFT - layout_png.RIGHT
    # the newest row of the heatmap, block 6 (cached) and block 1 (allocated)
    row = top + layout_png.PLOT_H - 2
    assert rgb.getpixel((layout_png.LEFT + int(6.5 * plot_w / 10), row)) == palette.rgb(
        palette.STATE_COLORS["cached"])
    assert rgb.getpixel((layout_png.LEFT + int(1.5 * plot_w / 10), row)) == palette.rgb(
        palette.STATE_COLORS["allocated"])


def test_dump_closes_its_connections(sidecar: str, tmp_path: Path) -> None:
    """No client socket is left for the collector: its finalizer's ResourceWarning, run
    by a collection inside an import (the PNG's lazy PIL import), broke that import with
    ``KeyError: <thread id>`` (CPython gh-91351, before 3.12): this test file failed 2 of
    6 runs of the unit suite so."""
    port = sidecar.rsplit(":", 1)[1]
    gc.collect()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        assert dump("--output", str(tmp_path / "a.json"), "--url", sidecar, "--token", "tk") == 0
        assert dump("--output", str(tmp_path / "b.json"), "--url", sidecar, "--pid", "4242",
                    "--token", "tk") == 1
        gc.collect()
    unclosed = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)
                and f"raddr=('127.0.0.1', {port})" in str(w.message)]
    assert unclosed == []


def test_pid_finds_the_sidecar_through_kvscope_url(
    sidecar: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("KVSCOPE_URL", sidecar)
    out = tmp_path / "one.json"
    assert dump("--output", str(out), "--url", dead, "--pid", "1", "--token", "tk",
                "--history", "0", "--timeout", "2") == 0
    body = json.loads(out.read_text())
    jsonschema.validate(body, SCHEMA)
    assert body["source"] == sidecar and [e["pid"] for e in body["engines"]] == [1]


def test_an_unknown_pid_fails_clearly(
    sidecar: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVSCOPE_URL", raising=False)
    assert dump("--output", str(tmp_path / "x.json"), "--url", sidecar, "--pid", "4242",
                "--token", "tk", "--timeout", "2") == 1
    err = capsys.readouterr().err
    assert "no sidecar serves a vLLM engine with pid 4242" in err
    assert f"{sidecar}: engine 0 pid 1" in err
    assert not (tmp_path / "x.json").exists()


def test_a_missing_token_is_named(sidecar: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert dump("--output", str(tmp_path / "x.json"), "--url", sidecar, "--token", "") == 1
    assert "unauthorized" in capsys.readouterr().err


def test_module_runs_as_a_script(sidecar: str, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, "-m", "kvscope.layout.dump", "layout", "dump",
                        "--output", str(out), "--url", sidecar, "--token", "tk"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stderr and json.loads(out.read_text())["format"] == layout_dump.FORMAT
