"""Which threads call the probe's transport functions that can wait (open a socket, wait
for a connection, send): the engine thread must never be one of them."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvscope_probe import transport

CAN_WAIT = ("push_socket", "await_connection", "send")


def threads_that_wait(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    """``{function: names of the threads that called it}``, from now on."""
    seen: dict[str, set[str]] = {}
    for name in CAN_WAIT:
        real = getattr(transport, name)

        def on_thread(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            seen.setdefault(_name, set()).add(threading.current_thread().name)
            return _real(*a, **k)

        monkeypatch.setattr(transport, name, on_thread)
    return seen
