"""Property 7: a prompt, an API key or a store password never comes out anywhere.

End to end: requests with a canary prompt and a canary API key go through kvscope's
middleware in front of a stand-in for vLLM's OpenAI server, which submits them to vLLM's
real scheduler (the twin, probe attached); a real ``kvscope serve`` with the embedded
store joins both streams. Then every place kvscope writes is searched: every column of
every table in chDB, the spool, the decision log, /metrics, every JSON route, the
sidecar's own output, and the raw bytes of its data directory. A second sidecar writes to
a ClickHouse DSN with a password, on a closed port: the password must not show either.
Stored hashes are keyed: the prompt's and the key's plain SHA-256 (which anyone could
compute from a guess) appear nowhere, nor does the sidecar's secret outside its own file.
Positive controls (the keyed hashes, the client ID) prove the rows were there to search.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvscope.state.hashkey import KEY_FILE_NAME, Keyer, read_key
from kvscope.twin.workload import TOKEN_ID_MAX, TOKEN_ID_MIN, TwinRequest
from kvscope_probe import plugin
from kvscope_probe.middleware import KVScopeMiddleware, prompt_digest, sha256_hex
from tests.reliability.serveproc import ServeProcess, wait_until
from tests.reliability.stores import read_store
from tests.reliability.twindrive import TwinDriver

pytestmark = [pytest.mark.reliability, pytest.mark.twin]
pytest.importorskip("kvscope.twin.engine")

CANARY = f"CANARY-{secrets.token_hex(8)} please summarise the quarterly numbers"
API_KEY = f"sk-canary-{secrets.token_hex(12)}"
PASSWORD = f"pw-canary-{secrets.token_hex(8)}"
CLIENT = "team-privacy"
ROUTES = ["/metrics", "/healthz", "/readyz", "/api/engines", "/api/layout", "/api/layout/history",
          "/health/preempt-rate", "/openapi.json", "/ui"]


def stand_in(drv: TwinDriver | None) -> FastAPI:
    """vLLM's OpenAI routes, reduced: the prompt becomes token IDs for the twin, and the
    engine request ID embeds the X-Request-Id the middleware set, as vLLM 0.32 does. As
    vLLM, it answers once the engine has ended the request (its arrival, stamped by the
    engine, falls inside the call's span, which is how the sidecar joins a trace)."""
    app = FastAPI()

    async def submit(engine_id: str, text: str, max_tokens: int) -> None:
        span = TOKEN_ID_MAX - TOKEN_ID_MIN
        tokens = tuple(TOKEN_ID_MIN + b % span for b in text.encode())
        if drv is None:
            return
        drv.inbox.put(TwinRequest(engine_id, tokens, max_tokens, 0, 0))
        deadline = time.monotonic() + 30
        while (engine_id not in drv.added or engine_id in drv.scheduler.requests) and (
                time.monotonic() < deadline):
            await asyncio.sleep(0.002)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        engine_id = f"cmpl-{request.headers['x-request-id']}-0-{secrets.token_hex(4)}"
        await submit(engine_id, body["prompt"], body.get("max_tokens", 8))
        return {"id": engine_id, "choices": [{"text": "ok"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        engine_id = f"chatcmpl-{request.headers['x-request-id']}-{secrets.token_hex(4)}"
        await submit(engine_id, " ".join(m["content"] for m in body["messages"]), 8)
        return {"id": engine_id}

    return app


def send_canaries(app: FastAPI, endpoint: str) -> int:
    app.add_middleware(KVScopeMiddleware, endpoint=endpoint)
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Client-Id": CLIENT,
               "User-Agent": "privacy-test/1"}
    n = 0
    with TestClient(app) as client:
        for i in range(20):
            r = client.post("/v1/completions", headers=headers,
                            json={"model": "tiny", "prompt": CANARY, "max_tokens": 4 + i % 4})
            assert r.status_code == 200
            n += 1
        for _ in range(5):
            r = client.post("/v1/chat/completions", headers=headers, json={
                "model": "tiny", "messages": [{"role": "user", "content": CANARY}]})
            assert r.status_code == 200
            n += 1
    return n


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_texts(side: ServeProcess) -> dict[str, str]:
    return {path: side.get(path).text for path in ROUTES}


def raw_hits(roots: list[Path], needles: list[str]) -> tuple[int, dict[str, list[str]]]:
    """Files under each root whose bytes contain a needle (compressed store parts may hide
    one; the queries over every column are the real search), the secret's own file
    aside. Returns the number of files read and, per needle, where it was found."""
    hits: dict[str, list[str]] = {n: [] for n in needles}
    files = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = Path(dirpath) / name
                if name == KEY_FILE_NAME:
                    continue
                try:
                    data = path.read_bytes()
                except OSError:
                    continue
                files += 1
                for n in needles:
                    if n.encode() in data:
                        hits[n].append(str(path.relative_to(root)))
    return files, hits


def send_through_two_sidecars(
        tmp_path: Path) -> tuple[ServeProcess, ServeProcess, int, dict[str, dict[str, str]]]:
    """The canaries through the middleware to a sidecar with the embedded store (its twin
    engine running them) and to one whose ClickHouse DSN carries the password, on a closed
    port. Both stopped once the traces are joined and the delivery has failed. Returns the
    two sidecars, the requests sent to the store's, and each one's pages (``ROUTES``)."""
    store_side = ServeProcess(tmp_path / "c", args=["--log-level", "debug"])
    pw_side = ServeProcess(tmp_path / "p", args=[
        "--log-level", "debug", "--clickhouse-dsn",
        f"http://kvuser:{PASSWORD}@127.0.0.1:{closed_port()}/kvscope"])
    drv: TwinDriver | None = None
    try:
        store_side.start()
        pw_side.start()
        drv = TwinDriver(store_side.endpoint, step_s=0.002, in_flight=6).start()
        sent = send_canaries(stand_in(drv), store_side.endpoint)
        send_canaries(stand_in(None), pw_side.endpoint)
        wait_until("the canary requests' traces to be joined to their client events",
                   lambda: (store_side.value("kvscope_client_traces_joined_total") or 0)
                   >= sent, 60)
        wait_until("the password store to fail a delivery",
                   lambda: "delivery failed" in pw_side.stderr(), 30)
        http = {"store": http_texts(store_side), "password": http_texts(pw_side)}
        drv.pause()
        for side in (store_side, pw_side):
            code, _ = side.terminate(20)
            assert code is not None
    finally:
        if drv is not None:
            drv.stop()
        plugin.stop_all()
        store_side.stop()
        pw_side.stop()
    return store_side, pw_side, sent, http


def secrets_and_keyed_hashes(store_side: ServeProcess,
                             pw_side: ServeProcess) -> tuple[list[str], str, str]:
    """What must appear nowhere (the canaries, their plain SHA-256 in full and truncated,
    both sidecars' secrets), and the keyed hashes of the prompt and the key, which must."""
    plain_prompt = prompt_digest("completions", {"prompt": CANARY})[0]
    plain_key = sha256_hex(API_KEY.encode())
    secret = read_key(str(store_side.data_dir / KEY_FILE_NAME))
    phash = Keyer(secret)("prompt", plain_prompt)
    khash = Keyer(secret)("api_key", plain_key)
    secrets_ = [CANARY, CANARY.split()[0], API_KEY, PASSWORD, plain_prompt, plain_prompt[:16],
                plain_key, plain_key[:16], secret.decode(),
                read_key(str(pw_side.data_dir / KEY_FILE_NAME)).decode()]
    return secrets_, phash, khash


def texts_written(sides: tuple[ServeProcess, ServeProcess], http: dict[str, dict[str, str]],
                  test_logs: str) -> dict[str, str]:
    """Every text kvscope wrote or served, by where: output, decision log, logs, pages."""
    return {
        "sidecar stderr": "".join(side.stderr() for side in sides),
        "sidecar stdout": "".join(side.stdout() for side in sides),
        "decision log": "".join(p.read_text() for side in sides
                                for p in side.workdir.glob("decisions.jsonl*")),
        "test-process logs": test_logs,
        **{f"{who} {path}": text for who, pages in http.items() for path, text in pages.items()},
    }


def test_a_canary_prompt_key_and_password_appear_nowhere(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    store_side, pw_side, sent, http = send_through_two_sidecars(tmp_path)

    secrets_, phash, khash = secrets_and_keyed_hashes(store_side, pw_side)
    store = read_store(str(store_side.data_dir / "chdb"), [*secrets_, phash, khash, CLIENT])
    hits = store["hits"]
    texts = texts_written((store_side, pw_side), http, caplog.text)
    files, raw = raw_hits([store_side.workdir, pw_side.workdir], secrets_)
    leaks = {s: [where for where, text in texts.items() if s in text] for s in secrets_}
    print(f"\nproperty 7: {sent} canary requests joined end to end; searched "
          f"{len(store['tables'])} tables (every column), {len(texts)} texts "
          f"({sum(map(len, texts.values())) // 1024} KiB), {files} files; store rows "
          f"{ {t: v['rows'] for t, v in store['tables'].items()} }; hits of the prompt hash "
          f"{hits[phash]}, of the key hash {hits[khash]}; leaks {leaks}, in the store "
          f"{ {s: hits[s] for s in secrets_} }, in files {raw}")
    for s in secrets_:
        assert not leaks[s] and not hits[s] and not raw[s], s
    # the rows were there to search: hashes and the client ID, never the values they hide
    assert {t for t, _, _ in hits[phash]} >= {"client_requests", "request_traces"}
    assert any(t == "client_requests" and c == "api_key_hash" for t, c, _ in hits[khash])
    assert any(t == "request_traces" for t, _, _ in hits[CLIENT])
    assert f'client="{CLIENT}"' in http["store"]["/metrics"]
    # the password store did fail, and said so without the password
    assert "delivery failed" in texts["sidecar stderr"]
    assert "Connection refused" in texts["sidecar stderr"]
