"""The sidecar's own CPU by thread (``kvscope_sidecar_cpu_seconds_total``) and memory: each
thread's CPU under its bounded label, exactly as the kernel counts it, never going back."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.os_thread import name_os_thread
from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.sidecar.exposition.own_cpu import MAIN, OTHER, THREAD_LABELS, OwnCpu
from kvscope.state.hub import Hub


class Burner:
    """A thread that runs ``cpu_s`` of CPU, reads its own CPU clock, then sleeps until
    released and reads it again."""

    def __init__(self, name: str, cpu_s: float = 0.05) -> None:
        self.cpu_s = cpu_s
        self.before_sleep = self.after_wake = -1.0
        self.tid = 0
        self._ready = threading.Event()
        self._go = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        name_os_thread()
        self.tid = threading.get_native_id()
        t0 = time.thread_time()
        while time.thread_time() - t0 < self.cpu_s:
            pass
        self.before_sleep = time.thread_time()
        self._ready.set()
        self._go.wait()
        self.after_wake = time.thread_time()

    def start_and_sleep(self) -> None:
        """Start; return once the thread is asleep (the kernel has stopped its clock)."""
        self.thread.start()
        assert self._ready.wait(10)
        stat = Path(f"/proc/self/task/{self.tid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rpartition(")")[2].split()[0] != "S":
            assert time.monotonic() < deadline, "the thread never slept"
            time.sleep(0.001)

    def release(self) -> None:
        """Let it end; return once the kernel has let it go too (Python's join returns
        before the thread has left the kernel)."""
        self._go.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        task = Path(f"/proc/self/task/{self.tid}")
        deadline = time.monotonic() + 10
        while task.exists():
            assert time.monotonic() < deadline, "the thread never left"
            time.sleep(0.001)


def counted_asleep(name: str, label: str) -> tuple[OwnCpu, Burner, float]:
    """A reader, a burner named ``name`` that has run and ended, and what the reader
    counted under ``label`` while the burner slept."""
    own = OwnCpu()
    burner = Burner(name)
    burner.start_and_sleep()
    counted = own.cpu_seconds()[label]
    burner.release()
    return own, burner, counted


def test_a_named_thread_is_counted_under_its_name_exactly() -> None:
    _, burner, counted = counted_asleep("kvscope-ingest", "ingest")
    # the kernel's count while it slept lies between its own clock before and after
    assert burner.before_sleep <= counted <= burner.after_wake
    assert counted >= burner.cpu_s


def test_a_thread_that_ended_keeps_its_count() -> None:
    own, _, counted = counted_asleep("kvscope-layout", "layout")
    after = own.cpu_seconds()
    assert after["layout"] == counted  # gone from /proc: nothing added, nothing taken back
    assert set(after) <= set(THREAD_LABELS)


def test_labels_stay_bounded() -> None:
    """A thread kvscope did not name (or named outside the list) is ``other``; the main
    thread is ``main``."""
    own = OwnCpu()
    before = own.cpu_seconds()
    rogue = Burner("kvscope-rogue-thread-7")
    rogue.start_and_sleep()
    after = own.cpu_seconds()
    rogue.release()
    assert "rogue-thread-7" not in after and set(after) <= set(THREAD_LABELS)
    assert after[OTHER] - before.get(OTHER, 0.0) >= rogue.cpu_s
    assert after[MAIN] > 0


def fake_proc(root: Path, threads: dict[int, tuple[str, int]], rss_pages: int) -> None:
    for tid, (comm, ns) in threads.items():
        task = root / "task" / str(tid)
        task.mkdir(parents=True, exist_ok=True)
        (task / "comm").write_text(comm + "\n")
        (task / "schedstat").write_text(f"{ns} 0 1\n")
    (root / "statm").write_text(f"1000 {rss_pages} 10 1 0 100 0\n")


def test_a_reused_thread_id_adds_the_new_threads_cpu(tmp_path: Path) -> None:
    """An ID whose count went down belongs to a new thread: all of its count is new."""
    own = OwnCpu(str(tmp_path))
    fake_proc(tmp_path, {7: ("ZMQbg/IO/0", 500_000_000), 8: ("BgSchPool", 100)}, 25)
    assert own.cpu_seconds() == {OTHER: 500_000_100 / 1e9}
    fake_proc(tmp_path, {7: ("ZMQbg/IO/0", 200_000_000), 8: ("BgSchPool", 300)}, 25)
    assert own.cpu_seconds() == {OTHER: 700_000_300 / 1e9}
    fake_proc(tmp_path, {7: ("ZMQbg/IO/0", 300_000_000), 8: ("BgSchPool", 300)}, 25)
    assert own.cpu_seconds() == {OTHER: 800_000_300 / 1e9}
    assert own.resident_bytes() == 25 * os.sysconf("SC_PAGE_SIZE")


def test_a_native_thread_with_a_kvscope_name_is_other(tmp_path: Path) -> None:
    """The embedded store's worker threads, started by its sending thread, inherit that
    thread's kernel name: only Python's own threads take their names as labels."""
    fake_proc(tmp_path, {9: ("clickhouse-send", 2_000), 10: ("ingest", 3_000)}, 1)
    assert OwnCpu(str(tmp_path)).cpu_seconds() == {OTHER: 5_000 / 1e9}


def scrape(own: OwnCpu) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(KVScopeCollector(Hub(), own=own))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples if s.name.startswith("kvscope_sidecar_")}


def test_the_collector_exports_them(tmp_path: Path) -> None:
    fake_proc(tmp_path, {7: ("ZMQbg/IO/0", 1_500_000_000)}, 40)
    assert scrape(OwnCpu(str(tmp_path))) == {
        ("kvscope_sidecar_cpu_seconds_total", (("thread", OTHER),)): 1.5,
        ("kvscope_sidecar_resident_memory_bytes", ()): 40.0 * os.sysconf("SC_PAGE_SIZE"),
    }


@pytest.mark.parametrize("make", [lambda p: OwnCpu(str(p / "absent")), lambda p: None])
def test_nothing_without_proc(tmp_path: Path, make: Callable[[Path], OwnCpu | None]) -> None:
    own = make(tmp_path)
    if own is not None:
        assert own.cpu_seconds() == {} and own.resident_bytes() is None
    registry = CollectorRegistry()
    registry.register(KVScopeCollector(Hub(), own=own))
    assert b"kvscope_sidecar_" not in generate_latest(registry)
