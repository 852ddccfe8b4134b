"""``/api/requests/{id}`` when the store fails after the client connected: a 503 that
names the error's type, as when it cannot connect; never a 500 with a traceback."""

from __future__ import annotations

from typing import Any

from clickhouse_connect.driver.exceptions import OperationalError
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvscope.explain.api import explain_router


class DroppedStore:
    closed = False

    def query(self, *_a: Any, **_k: Any) -> Any:
        raise OperationalError("the connection to the store was reset mid-query")

    def command(self, *_a: Any, **_k: Any) -> Any:
        return self.query()

    def close(self) -> None:
        self.closed = True


def test_a_store_that_fails_mid_answer_is_a_503() -> None:
    store = DroppedStore()
    app = FastAPI()
    app.include_router(explain_router(lambda: store))
    r = TestClient(app, raise_server_exceptions=False).get("/api/requests/cmpl-abc-0-deadbeef")
    assert (r.status_code, r.json()) == (503, {"detail": "store unavailable (OperationalError)"})
    assert store.closed
    assert "mid-query" not in r.text  # the store's message (its host, its SQL) stays in
