"""Optional push of the decision log to Loki's HTTP API, with the ClickHouse sink's spool.

Batches go through ``Delivery`` (queue -> write-ahead spool -> send, retries with backoff,
replay after an outage or a crash, every dropped row counted). Each decision becomes one
JSON line (the decision log's own line) in a stream labelled ``job``, ``server``,
``engine`` and ``event``, like the Alloy pipeline in ``loki/config.alloy``. A replayed
batch repeats the same stream, timestamp and line, which Loki stores once.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvscope.decisions.log import decision_line
from kvscope.redact import safe_url
from kvscope.sinks.base import BatchRejected
from kvscope.sinks.delivery import Delivery
from kvscope.sinks.options import DeliveryOptions
from kvscope.sinks.spool import Spool, SpooledBatch

PUSH_PATH = "/loki/api/v1/push"


def push_payload(rows: list[Any], job: str = "kvscope") -> bytes:
    """Loki's JSON push body for these decisions, one stream per (server, engine, event)."""
    streams: dict[tuple[str, str, str], list[list[str]]] = defaultdict(list)
    for d in rows:
        streams[(d.server, d.engine, d.decision)].append([str(int(d.ts * 1e9)),
                                                           decision_line(d)])
    return json.dumps({"streams": [
        {"stream": {"job": job, **({"server": server} if server else {}), "engine": engine,
                    "event": event}, "values": values}  # Loki takes no empty label value
        for (server, engine, event), values in sorted(streams.items())
    ]}, separators=(",", ":")).encode()



class LokiSink:
    """Pushes scheduler decisions to ``<url>/loki/api/v1/push``."""

    name = "loki"

    def __init__(self, url: str, spool_dir: str, *, tenant: str | None = None,
                 options: DeliveryOptions | None = None, timeout_s: float = 10.0) -> None:
        p = urlsplit(url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError("Loki URL must be http(s)://host[:port]")
        self.url = url.rstrip("/")
        self.safe_url = safe_url(self.url)
        self.headers = {"Content-Type": "application/json"}
        if tenant:
            self.headers["X-Scope-OrgID"] = tenant
        self.options = options or DeliveryOptions(batch_rows=1000)
        self._http = httpx.Client(timeout=timeout_s, trust_env=False)
        os.makedirs(spool_dir, exist_ok=True)
        self.spool = Spool(spool_dir, max_bytes=self.options.spool_max_bytes,
                           policy=self.options.spool_policy, fsync=self.options.fsync)
        self.delivery = Delivery(self.name, ["scheduler_decisions"],
                                 lambda _t, rows: push_payload(rows), self._send, self.spool,
                                 self.options, describe=self.describe, check=self._check)
        self.delivery.start()

    def describe(self, exc: BaseException) -> str:
        return f"{type(exc).__name__} pushing to {self.safe_url}"

    def _send(self, batch: SpooledBatch, payload: bytes, attempt: int) -> None:
        resp = self._http.post(f"{self.url}{PUSH_PATH}", content=payload, headers=self.headers)
        if resp.status_code in (400, 413) and attempt >= 4:
            raise BatchRejected(f"Loki refused the batch: HTTP {resp.status_code}")
        resp.raise_for_status()

    def _check(self) -> None:
        """A push of no streams: Loki answers 204 (before 3.2) or 422 "missing streams"
        (grafana/loki#13706) once the request has passed its gateway and tenant checks."""
        resp = self._http.post(f"{self.url}{PUSH_PATH}", content=b'{"streams":[]}',
                               headers=self.headers)
        if resp.status_code not in (204, 422):  # a 200 or a redirect is not Loki either
            raise httpx.HTTPStatusError(f"HTTP {resp.status_code}", request=resp.request,
                                        response=resp)

    def accepts(self, table: str) -> bool:
        return table == "scheduler_decisions"

    def write(self, table: str, row: Any) -> None:
        self.delivery.take(table, row)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.delivery.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        done = self.delivery.close(timeout_s)
        self._http.close()
        return done

    def stats(self) -> Any:
        return self.delivery.stats()
