"""The shipped Alertmanager configuration (deploy/alertmanager/alertmanager.yml), live.

``engine`` is vLLM's data-parallel index: every one-GPU server is engine "0". A paging
alert on one server must not silence, nor share a notification group with, the same
alert on another server. Run against the Debian Alertmanager, alerts posted to its API.
"""

from __future__ import annotations

import datetime as dt
import socket
from pathlib import Path
from typing import Any

import httpx

from tests.stack.promstack import Proc, binary, ready, wait_for

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "alertmanager" / "alertmanager.yml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alert(server: str, severity: str) -> dict[str, Any]:
    now = dt.datetime.now(dt.timezone.utc)
    return {"labels": {"alertname": "KVScopePreemptionRateHigh", "job": "kvscope",
                       "server": server, "engine": "0", "model": "m", "severity": severity},
            "startsAt": now.isoformat(),
            "endsAt": (now + dt.timedelta(hours=1)).isoformat()}


def test_a_page_on_one_server_silences_nothing_on_another(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    am = Proc("alertmanager", [
        binary("prometheus-alertmanager"), f"--config.file={CONFIG}",
        f"--storage.path={tmp_path / 'am'}", f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address="], tmp_path / "am.log")
    try:
        wait_for("Alertmanager ready", lambda: ready(base), 30)
        posted = [alert("gpu-a:8000", "critical"), alert("gpu-b:8000", "warning"),
                  alert("gpu-a:8000", "warning")]
        assert httpx.post(f"{base}/api/v2/alerts", json=posted, timeout=5).status_code == 200

        def states() -> dict[tuple[str, str], str] | None:
            got = httpx.get(f"{base}/api/v2/alerts", timeout=5).json()
            out = {(a["labels"]["server"], a["labels"]["severity"]): a["status"]["state"]
                   for a in got}
            return out if len(out) == 3 and "unprocessed" not in out.values() else None

        seen = wait_for("the alerts processed", states, 30)
        assert seen == {("gpu-a:8000", "critical"): "active",
                        ("gpu-b:8000", "warning"): "active",  # another server's: its own
                        ("gpu-a:8000", "warning"): "suppressed"}  # the page's lesser copy
        groups = httpx.get(f"{base}/api/v2/alerts/groups", timeout=5).json()
        servers = [{a["labels"]["server"] for a in g["alerts"]} for g in groups]
        assert all(len(s) == 1 for s in servers), servers  # one server a notification
    finally:
        am.stop()
