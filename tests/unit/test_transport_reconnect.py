"""With no sidecar listening, the probe's socket retries its connection less and less
often, up to once a second (``transport.RECONNECT_IVL_MAX_MS``): libzmq's I/O thread in the
engine process otherwise retries every 100 ms for as long as the sidecar is away."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvscope.localvllm.server import free_port
from kvscope_probe import transport

STEP_MS = 100
"""libzmq's ZMQ_RECONNECT_IVL (left at its default): the first wait, and the width of the
random part it adds to each wait."""


def retry_waits(endpoint: str, n: int) -> list[int]:
    """The waits (ms) libzmq reports for the socket's next ``n`` failed connection tries."""
    sock = transport.push_socket(endpoint, hwm=4, secret=b"s" * 32)
    mon = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED)
    try:
        waits = []
        while len(waits) < n:
            assert mon.poll(10_000), f"no retry reported after {waits}"
            waits.append(recv_monitor_message(mon)["value"])
        return waits
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_a_missing_sidecar_is_retried_ever_less_often_up_to_a_second(
        tmp_path: Path, kind: str) -> None:
    endpoint = (f"ipc://{tmp_path}/nobody.sock" if kind == "ipc"
                else f"tcp://127.0.0.1:{free_port()}")
    waits = retry_waits(endpoint, 6)
    # Each wait is a base plus up to STEP_MS of jitter; the base doubles from STEP_MS up to
    # the cap. The monitor starts after connect(), so the first tries may go unreported.
    bases = [w // STEP_MS * STEP_MS for w in waits]
    assert all(b <= w < b + STEP_MS for b, w in zip(bases, waits, strict=True))
    assert all(nxt == min(2 * b, transport.RECONNECT_IVL_MAX_MS)
               for b, nxt in zip(bases, bases[1:], strict=False)), waits
    assert bases[-2:] == [transport.RECONNECT_IVL_MAX_MS] * 2
