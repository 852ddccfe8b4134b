"""``kvscope loadgen`` against a stand-in OpenAI server on a free loopback port."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvscope.load import cli as loadgen
from kvscope.load.mix import LoadSpec, build_requests

FAIL_EVERY = 5
"""The stand-in answers 503 to every request whose index is 4 mod 5."""


@dataclass
class Seen:
    """What the stand-in server received."""

    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


def completions_app(seen: Seen) -> FastAPI:
    """Imitates vLLM's ``POST /v1/completions`` as the load generator reads it: the
    response id is ``cmpl-<X-Request-Id>``, ``usage`` counts prompt words (one token each
    in the tiny model) and ``max_tokens`` completion tokens (``ignore_eos``), and the time
    taken grows with ``max_tokens``. Every fifth request gets vLLM's overload answer, 503."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        seen.headers.append(dict(request.headers))
        seen.bodies.append(body)
        seen.in_flight += 1
        seen.peak_in_flight = max(seen.peak_in_flight, seen.in_flight)
        try:
            await asyncio.sleep(body["max_tokens"] / 20_000)
        finally:
            seen.in_flight -= 1
        rid = request.headers["x-request-id"]
        if int(rid.rsplit("-", 1)[1]) % FAIL_EVERY == FAIL_EVERY - 1:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        prompt, completion = len(body["prompt"].split()), body["max_tokens"]
        return {
            "id": f"cmpl-{rid}", "object": "text_completion", "model": body["model"],
            "choices": [{"index": 0, "text": " w1" * completion, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
        }

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Seen]]:
    """The stand-in under uvicorn in a thread, on a port the kernel picked."""
    seen = Seen()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(completions_app(seen), log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started, "stand-in server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    srv.should_exit = True
    thread.join(10)
    sock.close()


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvscope")
    loadgen.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["loadgen", *argv])


def test_load_is_bounded_tagged_and_summarised(
        server: tuple[str, Seen], capsys: pytest.CaptureFixture[str]) -> None:
    url, seen = server
    seen.headers.clear()
    seen.bodies.clear()
    n, concurrency = 30, 4
    args = parse("--url", url, "--requests", str(n), "--concurrency", str(concurrency),
                 "--seed", "3", "--max-tokens", "20:200", "--client-id", "team-a",
                 "--api-key", "k", "--header", "X-Extra: 1", "--format", "json", "--quiet")
    assert loadgen.run(args) == 1  # some requests got 503
    summary = json.loads(capsys.readouterr().out)

    assert len(seen.bodies) == n and seen.peak_in_flight <= concurrency
    assert all(h["x-client-id"] == "team-a" and h["authorization"] == "Bearer k"
               and h["user-agent"].startswith("kvscope-loadgen/") and h["x-extra"] == "1"
               for h in seen.headers)
    bodies = build_requests(LoadSpec(n_requests=n, seed=3, max_tokens=(20, 200)))
    failed = {i for i in range(n) if i % FAIL_EVERY == FAIL_EVERY - 1}
    ok = [b for i, b in enumerate(bodies) if i not in failed]
    assert summary["requests"] == n and summary["ok"] == len(ok)
    assert summary["error_count"] == len(failed)
    assert summary["errors"][0].startswith("HTTP 503")
    assert summary["completion_tokens"] == sum(b["max_tokens"] for b in ok)
    assert summary["prompt_tokens"] == sum(len(b["prompt"].split()) for b in ok)
    rate = summary["completion_tokens"] / summary["elapsed_s"]
    assert summary["completion_tokens_per_s"] == pytest.approx(rate)
    # Latency follows max_tokens in the stand-in: p50 sits between the bounds, p99 near top.
    assert 20 / 20_000 <= summary["latency_p50_s"] <= summary["latency_p99_s"]
    assert summary["latency_p99_s"] <= summary["latency_max_s"] < 30


def test_progress_is_called_and_text_summary_printed(
        server: tuple[str, Seen], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = server
    stream = io.StringIO()
    made: list[loadgen.Progress] = []
    real = loadgen.Progress

    def progress(total: int) -> loadgen.Progress:
        made.append(real(total, stream, interval_s=0.0))  # a line per finished request
        return made[-1]

    monkeypatch.setattr(loadgen, "Progress", progress)
    assert loadgen.run(parse("--url", url, "--requests", "4", "--max-tokens", "5:10")) == 0
    out = capsys.readouterr().out
    assert made[0].done == 4 and made[0].errors == 0
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("4/4 done, 0 errors")
    assert "requests   4 (ok 4, errors 0)" in out and "completion tokens/s" in out


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    stream = io.StringIO()
    progress = loadgen.Progress(3, stream, tty=True)
    for i in range(3):
        progress(loadgen.RequestOutcome(i, True, 200, 0.1, 1, 1, None))
    progress.finish()
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    assert text.rstrip("\n").rsplit("\r", 1)[-1].startswith("3/3 done, 0 errors")


@pytest.mark.parametrize("url", ["http://10.0.0.7:8000", "http://example.com",
                                 "https://8.8.8.8/v1", "http://[2001:db8::1]:8000"])
def test_non_loopback_is_refused_without_allow_remote(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert loadgen.run(parse("--url", url, "--requests", "1")) == 2
    assert "--allow-remote" in capsys.readouterr().err
    spec, errors = loadgen.plan(parse("--url", url, "--allow-remote"))
    assert spec is not None and errors == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1",
                                 "http://127.0.0.2", "http://[::1]:8000"])
def test_loopback_needs_no_permission(url: str) -> None:
    spec, errors = loadgen.plan(parse("--url", url))
    assert spec is not None and errors == []


def test_bad_arguments_are_reported_together(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--url", "ftp://x", "--concurrency", "0", "--max-tokens", "9:3",
                 "--priority", "a:b", "--header", "novalue")
    assert loadgen.run(args) == 2
    err = capsys.readouterr().err
    for part in ("--url", "concurrency", "max_tokens", "--priority", "--header"):
        assert part in err


def test_a_header_http_cannot_carry_is_refused_without_showing_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A key with a control character failed every request inside the load (reported as
    cut off by the deadline), and h11's error, printed among the first errors, quoted it."""
    args = parse("--api-key", "sk-secret\r\nX: y", "--user-agent", "caf\u00e9/1",
                 "--header", "X-Team: ok")
    assert loadgen.run(args) == 2
    err = capsys.readouterr().err
    assert "--api-key: the Authorization header must be printable ASCII" in err
    assert "--user-agent: the User-Agent header must be printable ASCII" in err
    assert "sk-secret" not in err and "X-Team" not in err
