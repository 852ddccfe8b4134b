"""Numbered synthetic trace rows and a store that can be taken down, for delivery tests."""

from __future__ import annotations

import threading
import time
from typing import Any

from clickhouse_connect.driver.exceptions import OperationalError

from kvscope.rows import RequestTrace


def trace(i: int, ts: float | None = None) -> RequestTrace:
    """Request ``r<i>``; ``prompt_len`` carries ``i`` so a query can tell rows apart."""
    now = time.time() if ts is None else ts
    return RequestTrace(
        ts=now, model="m", engine="0", request_id=f"r{i:07d}", prompt_len=i, max_gen_len=16,
        output_len=16, required_blocks=2, allocated_blocks=2, contiguous_allocated=True,
        block_fragments=1, preempt_count=i % 3, preempt_reason="kv_full" if i % 3 else "",
        recomputed_tokens=0, cached_tokens=0, free_blocks_at_alloc=5,
        max_contiguous_free_blocks_at_alloc=5, arrival_ts=now - 1.0, queue_seconds=0.1,
        first_token_seconds=0.2, e2e_seconds=1.0, finish_reason="FINISHED_STOPPED")


class SwitchableStore:
    """Imitates a ClickHouse server that goes away and comes back: while ``down`` is set,
    connecting, inserting and commands raise the OperationalError clickhouse-connect raises for a
    refused connection; otherwise calls go to a real chDB client."""

    def __init__(self, connect: Any) -> None:
        self._connect = connect
        self.down = threading.Event()
        self.inserts = 0

    def connect(self) -> Any:
        self._refuse()
        return _Proxy(self, self._connect())

    def _refuse(self) -> None:
        if self.down.is_set():
            raise OperationalError("Error HTTPConnectionPool(host='127.0.0.1', port=8123): "
                                   "Connection refused executing HTTP request attempt 1")


class _Proxy:
    def __init__(self, store: SwitchableStore, client: Any) -> None:
        self._store, self._client = store, client

    def raw_insert(self, *args: Any, **kwargs: Any) -> Any:
        self._store._refuse()
        self._store.inserts += 1
        return self._client.raw_insert(*args, **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Any:
        self._store._refuse()
        return self._client.command(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
