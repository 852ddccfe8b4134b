"""Property 6: nobody gets in who should not.

``kvscope serve`` listens on 127.0.0.1 by default; any other bind without a token refuses to
start; the token guards every route the app has but /healthz and /readyz, and the guard's
decision is ``hmac.compare_digest``'s; with ``--tls-cert/--tls-key`` it speaks HTTPS and only HTTPS.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from kvscope.localvllm.server import free_port
from kvscope.sidecar.config import ServeConfig
from kvscope.sidecar.http import app as app_module
from kvscope.sidecar.server import Sidecar
from tests.reliability.serveproc import ROOT, ServeProcess, clean_env

pytestmark = pytest.mark.reliability

TOKEN = "s3cret-token-4f1c"
OFF = ["--clickhouse-dsn", "off", "--log-level", "warning"]


def serve_exit(args: list[str],
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvscope", "serve", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=clean_env(**(env or {})), stdin=subprocess.DEVNULL)


def test_the_default_bind_is_loopback(tmp_path: Path) -> None:
    side = ServeProcess(tmp_path / "s", args=OFF)
    try:
        side.start()
        listening = [c.laddr for c in psutil.Process(side.pid).net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        proc_tcp = Path("/proc/net/tcp").read_text().splitlines()[1:]
        # /proc/net/tcp: local address as little-endian hex IP:port, state 0A = LISTEN
        ours = [ln.split()[1] for ln in proc_tcp
                if ln.split()[3] == "0A" and ln.split()[1].endswith(f":{side.port:04X}")]
    finally:
        side.stop()
    print(f"\nproperty 6a: default bind listens on {listening}; /proc/net/tcp {ours}")
    assert [a.port for a in listening] == [side.port]
    assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening)
    assert ours == [f"0100007F:{side.port:04X}"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "", "example.com",
                                  "::ffff:7f00:1"])
def test_any_other_bind_without_a_token_refuses_to_start(host: str) -> None:
    port = free_port()
    out = serve_exit(["--host", host, "--port", str(port), *OFF])
    assert out.returncode == 2, out.stderr
    assert "needs a token" in out.stderr and "--token" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_the_environment_cannot_sneak_a_public_bind_in() -> None:
    out = serve_exit(["--port", str(free_port()), *OFF], env={"KVSCOPE_HOST": "0.0.0.0"})
    assert out.returncode == 2 and "needs a token" in out.stderr, out.stderr
    out = serve_exit(["--host", "0.0.0.0", "--port", str(free_port()), *OFF],
                     env={"KVSCOPE_TOKEN": ""})  # an empty token is no token
    assert out.returncode == 2 and "needs a token" in out.stderr, out.stderr


def app_routes(tmp_path: Path) -> list[tuple[str, str]]:
    """Every (method, path) of the app exactly as ``kvscope serve`` builds it."""
    cfg = ServeConfig(endpoints=(f"ipc://{tmp_path}/p.sock",), token=TOKEN,
                      clickhouse_dsn="off", decision_log="off", data_dir=str(tmp_path))
    out = []
    for r in Sidecar(cfg).app.routes:
        if isinstance(r, (APIRoute, Route)):
            out += [(m, r.path) for m in sorted(r.methods or ["GET"]) if m != "HEAD"]
    return out


def test_the_token_guards_every_route_but_the_health_probes(tmp_path: Path) -> None:
    routes = app_routes(tmp_path)
    side = ServeProcess(tmp_path / "s", args=OFF + ["--token", TOKEN], token=TOKEN)
    wrong = ["", "Bearer", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x",
             f"bearer {TOKEN}", f"Bearer  {TOKEN}", TOKEN, f"Basic {TOKEN}",
             f"Bearer {TOKEN.upper()}", "Bearer " + "\u00e9" * 8]
    tried = 0
    try:
        side.start()
        with httpx.Client(base_url=side.url, timeout=10, trust_env=False) as c:
            for method, path in routes:
                for auth in wrong:
                    headers = {"Authorization": auth.encode("utf-8")} if auth else {}
                    r = c.request(method, path, headers=headers)
                    tried += 1
                    if path in ("/healthz", "/readyz"):  # open for liveness / readiness probes
                        assert r.status_code in (200, 503), (method, path, auth)
                    else:
                        assert r.status_code == 401, (method, path, auth, r.status_code)
                r = c.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
                tried += 1
                assert r.status_code not in (401, 403), (method, path)
            # a route that does not exist says nothing without the token either
            assert c.get("/nope").status_code == 401
            # the query token opens the page a browser loads, and nothing else
            assert c.get("/ui", params={"token": TOKEN}).status_code == 200
            assert c.get("/ui", params={"token": TOKEN[:-1]}).status_code == 401
            for path in ("/metrics", "/api/engines", "/openapi.json", "/docs"):
                assert c.get(path, params={"token": TOKEN}).status_code == 401, path
    finally:
        side.stop()
    print(f"\nproperty 6b: {len(routes)} routes {sorted({p for _, p in routes})}, "
          f"{tried} guarded requests, 401 for all but the health probes without the right token")
    assert {"/metrics", "/api/engines", "/openapi.json", "/docs", "/ui"} <= {p for _, p in routes}


def test_the_guard_decides_by_compare_digest(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Behaviour, not timing: every guarded request is decided by hmac.compare_digest on
    bytes, and by nothing else (no early length or equality check in front of it)."""
    cfg = ServeConfig(endpoints=(f"ipc://{tmp_path}/p.sock",), token=TOKEN,
                      clickhouse_dsn="off", decision_log="off", data_dir=str(tmp_path))
    client = TestClient(Sidecar(cfg).app)
    calls: list[tuple[Any, Any]] = []
    answer = {"value": False}

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return answer["value"]

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    ok = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get("/metrics", headers=ok).status_code == 401  # it said no
    answer["value"] = True
    assert client.get("/metrics", headers={"Authorization": "x"}).status_code == 200
    assert client.get("/metrics").status_code == 200  # even with nothing: its word is final
    assert len(calls) == 3
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
    assert calls[0] == (f"Bearer {TOKEN}".encode(), f"Bearer {TOKEN}".encode())
    assert calls[1][0] == b"x" and calls[2][0] == b""
    client.get("/healthz")
    assert len(calls) == 3  # /healthz is never checked


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvscope-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


def test_tls_serves_https_and_only_https(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    side = ServeProcess(tmp_path / "s", token=TOKEN,
                        args=OFF + ["--token", TOKEN, "--tls-cert", str(cert),
                                    "--tls-key", str(key)])
    side.scheme = "https"
    side.verify = ssl.create_default_context(cafile=str(cert))
    try:
        side.start()
        r = side.get("/metrics")
        assert r.status_code == 200 and r.url.scheme == "https"
        assert side.get("/metrics", headers={"Authorization": "Bearer no"}).status_code == 401
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the cert
            httpx.get(f"{side.url}/healthz", timeout=5)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port: no answer
            httpx.get(f"http://127.0.0.1:{side.port}/metrics", timeout=5,
                      headers={"Authorization": f"Bearer {TOKEN}"})
        version = r.extensions.get("http_version")
    finally:
        side.stop()
    print(f"\nproperty 6c: --tls-cert/--tls-key: https answered ({version!r}), http refused, "
          "an untrusting client refused")


def test_tls_settings_are_checked_before_anything_starts(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    half = serve_exit(["--port", str(free_port()), "--tls-cert", str(cert), *OFF])
    assert half.returncode == 2 and "--tls-key" in half.stderr, half.stderr
    missing = serve_exit(["--port", str(free_port()), *OFF],
                         env={"KVSCOPE_TLS_CERT": str(cert),
                              "KVSCOPE_TLS_KEY": str(tmp_path / "nope.pem")})
    assert missing.returncode == 2 and "nope.pem" in missing.stderr, missing.stderr
