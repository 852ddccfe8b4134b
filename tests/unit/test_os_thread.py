"""The sidecar's threads carry their names into the kernel (CPU per thread is readable)."""

from __future__ import annotations

import threading
from pathlib import Path

from kvscope.os_thread import comm_name, name_os_thread


def _comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_a_thread_gets_its_python_name_in_the_kernel() -> None:
    seen: list[str] = []
    ready = threading.Event()

    def body() -> None:
        name_os_thread()
        seen.append(_comm(threading.get_native_id()))
        ready.set()

    t = threading.Thread(target=body, name="kvscope-clickhouse-batch")
    t.start()
    t.join(5)
    assert ready.is_set()
    assert seen == ["clickhouse-batc"]  # the prefix dropped, 15 bytes kept


def test_comm_name_is_ascii_and_bounded() -> None:
    assert comm_name("kvscope-ingest") == b"ingest"
    assert comm_name("décision-log-writer") == b"d?cision-log-wr"
    assert len(comm_name("x" * 100)) == 15


def test_the_ingest_threads_are_named(tmp_path: Path) -> None:
    from kvscope.sidecar.ingest.receiver import Receiver
    from kvscope.state.hub import Hub

    rx = Receiver(Hub(), [f"ipc://{tmp_path}/probe.sock"])
    rx.bind()
    rx.start()
    try:
        assert rx.ready.wait(5)
        ids = {rx.native_id, rx._ingest.native_id}
        names: set[str] = set()
        for _ in range(100):  # each thread names itself as it starts
            names = {_comm(i) for i in ids if i is not None}
            if names == {"receiver", "ingest"}:
                break
            threading.Event().wait(0.02)
        assert names == {"receiver", "ingest"}
    finally:
        rx.stop()
