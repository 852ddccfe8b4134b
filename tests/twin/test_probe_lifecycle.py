"""A sender lives as long as its scheduler; "switched off" leaves nothing behind."""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import pytest

from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin, recorder, sender, transport
from kvscope_probe.recorder import Recorder
from tests.twin.exactness import dict_materialised
from tests.twin.probe_trail import need_fails

pytestmark = pytest.mark.twin

Twin = pytest.importorskip("kvscope.twin.engine").Twin


def senders_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvscope-probe-sender"]


class Stalls:
    """What held a thread up while this test waited on it: the collector's pauses (by
    generation) while it waited, and, when it is still alive, where it stands."""

    def __init__(self) -> None:
        self.collections: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.collections.append((info["generation"], time.perf_counter() - self._t0))

    def join(self, thread: threading.Thread, timeout_s: float) -> str:
        """Join ``thread``; "" when it ended, else what may have held it."""
        t0 = time.monotonic()
        gc.callbacks.append(self._on_gc)
        try:
            thread.join(timeout_s)
        finally:
            gc.callbacks.remove(self._on_gc)
        if not thread.is_alive():
            return ""
        frame = sys._current_frames().get(thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame else "(no frame)"
        return (f"alive {time.monotonic() - t0:.2f} s after the stop; collections while "
                f"waiting (generation, s): {self.collections}; its stack:\n{stack}")


def test_three_schedulers_in_turn_leave_one_sender_and_no_pinned_pool(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As re-creating vllm.LLM does: each engine builds a scheduler (the probe attaches
    in its __init__), the previous one is dropped."""
    plugin.stop_all()
    monkeypatch.setenv(plugin.ENV_ENDPOINT, f"ipc://{tmp_path}/nobody.sock")
    monkeypatch.setenv("KVSCOPE_PROBE_FLUSH_S", "0.02")
    plugin.register()  # what vLLM calls in each of its processes
    try:
        dead: list[weakref.ref[Any]] = []
        twin = None
        for _ in range(3):
            if twin is not None:
                dead += [weakref.ref(twin.scheduler), weakref.ref(
                    twin.scheduler.kv_cache_manager.block_pool)]
            twin = Twin(TwinConfig(num_blocks=48), seed=3)
            assert isinstance(twin.scheduler._kvscope, Recorder)  # it records
            twin.run(generate(WorkloadSpec(n_requests=4, seed=1)))
        # A sender thread holds its Recorder for the moment of a wakeup: a collection
        # that falls into one frees it at the next. Each sender ends within a flush
        # interval of its Recorder going.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
                any(r() is not None for r in dead) or len(senders_alive()) > 1):
            gc.collect()
            time.sleep(0.05)
        assert [r() for r in dead] == [None] * 4  # schedulers and pools collected
        assert len(senders_alive()) == 1
        assert twin is not None and twin.scheduler._kvscope.enabled
    finally:
        plugin.stop_all()
        plugin.enable(None)


def test_switched_off_removes_the_blocks_needed_hook_and_every_hook_goes_inert(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The blocks-needed hook's own work raises, so the switch-off comes while it is
    # installed on vLLM's coordinator.
    NeedFails = need_fails(RuntimeError)  # noqa: N806 - a class

    monkeypatch.setattr(recorder, "MAX_FAULTS", 5)
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    rec = NeedFails(twin.scheduler, ring_size=1 << 20, keyframe_interval_s=3600)
    plugin.bind(twin.scheduler, rec)
    dict_at_start = dict_materialised(rec.mgr.coordinator)
    result = twin.run(generate(WorkloadSpec(n_requests=60, seed=3)))
    assert result.finished == 60
    assert not rec.enabled
    assert rec.faults == 5  # nothing ran after the switch-off
    coord = rec.mgr.coordinator
    assert coord.get_num_blocks_to_allocate is not rec.need_fn and not rec.need_armed
    assert dict_materialised(coord) == dict_at_start  # its attributes' slots kept


def test_vllms_shutdown_ends_the_sender_and_every_hook_passes_through(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """EngineCore.shutdown() calls Scheduler.shutdown(): from then on the probe records
    nothing, and its sender flushes and ends without waiting for the collector."""
    plugin.stop_all()
    monkeypatch.setenv(plugin.ENV_ENDPOINT, f"ipc://{tmp_path}/nobody.sock")
    monkeypatch.setenv("KVSCOPE_PROBE_FLUSH_S", "0.02")
    plugin.register()
    try:
        twin = Twin(TwinConfig(num_blocks=48), seed=3)
        rec = twin.scheduler._kvscope
        assert isinstance(rec, Recorder) and rec.enabled
        twin.run(generate(WorkloadSpec(n_requests=4, seed=1)))
        mine = [s for s in plugin._senders if s._rec() is rec]
        assert len(mine) == 1 and mine[0].is_alive()
        assert twin.scheduler.shutdown() is None  # vLLM's own method ran, its result kept
        assert not rec.enabled and mine[0].stop_event.is_set()
        # the flush is bounded at ~2 s (nobody reads this socket); it takes ~0.4 s here
        held = Stalls().join(mine[0], 5.0)
        assert not mine[0].is_alive(), held
        seq = rec.seq
        twin.run(generate(WorkloadSpec(n_requests=2, seed=2)))  # a scheduler used after it
        assert rec.seq == seq  # nothing recorded
    finally:
        plugin.stop_all()
        plugin.enable(None)


def test_the_last_flush_ends_at_its_deadline_however_the_ring_is_split(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full ring drops records, so what is left can be many short runs of sequence
    numbers, each its own frame; on a socket nobody reads each frame waits SEND_WAIT_MS
    and is dropped. The flush checked its deadline only between ``drain_once`` calls (up
    to 4 x MAX_BATCH frames each): a CI run's sender outlived vLLM's shutdown by 6.6 s.
    The waits now stop at the deadline, and what was not sent is counted dropped."""
    assert plugin.enable(None)
    twin = Twin(TwinConfig(num_blocks=48), seed=3)
    rec = Recorder(twin.scheduler, ring_size=1 << 20, keyframe_interval_s=3600)
    rec.push(rec.hello)
    data = rec.ring.pop()[1]
    n = 64
    rec.ring.extend((2 * i, data) for i in range(n))  # every run one record long
    rec.pushed_bytes = rec.popped_bytes + n * len(data)
    snd = sender.Sender(rec, f"ipc://{tmp_path}/nobody.sock")  # not started
    snd._sock = transport.push_socket(snd.endpoint, hwm=snd.hwm)
    waits: list[int] = []
    real_send = transport.send

    def send(sock: Any, parts: list[Any], wait_ms: int) -> bool:
        waits.append(wait_ms)
        return real_send(sock, parts, wait_ms)

    monkeypatch.setattr(transport, "send", send)
    budget_ms = 500
    try:
        snd.stop_event.set()  # vLLM shut the scheduler down: the loop's drain sends no more
        assert snd.drain_once() == 0 and len(rec.ring) == n and not waits
        snd._flush_left(time.monotonic() + budget_ms / 1000)
    finally:
        snd._sock.close(linger=0)
    assert not rec.ring and snd.sent == 0 and rec.send_dropped == n
    # the waits add up to the time the flush had (a ms of rounding each), not a frame's
    # wait for every run: 64 x 200 ms before
    assert waits and sum(waits) <= budget_ms + len(waits), waits


EXITING = """
import sys
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.engine import Twin
from kvscope_probe import plugin
plugin.register()
twin = Twin(TwinConfig(num_blocks=48), seed=3)
twin.run(generate(WorkloadSpec(n_requests=12, seed=1)))
print(twin.scheduler._kvscope.seq, flush=True)
"""


EXITING_FORKED = """
import multiprocessing, sys
def engine():
""" + "".join(f"    {line}\n" for line in EXITING.strip().splitlines()) + """
if __name__ == "__main__":
    p = multiprocessing.get_context("fork").Process(target=engine)
    p.start()
    p.join()
    sys.exit(p.exitcode)
"""
"""EXITING in a forked multiprocessing child, as vLLM starts its engine core: such a
child ends with ``os._exit`` after ``threading._shutdown()``; atexit handlers never run."""


@pytest.mark.parametrize("script", [EXITING, EXITING_FORKED], ids=["exit", "forked-child"])
def test_interpreter_exit_flushes_what_the_ring_holds(tmp_path: Any, script: str) -> None:
    """A process that exits without stopping the probe (as vLLM's engine core may): the
    sender's wakeup is 1 s apart, so most records are still in the ring at exit; the
    exit hook sends every one of them (each sequence number arrives exactly once). It
    runs where threads may still start (Python 3.12 refuses a new thread in an atexit
    handler, and ending the probe's context starts one), and in a forked child, whose
    exit runs no atexit handler."""
    import os
    import subprocess
    import sys

    import zmq

    from kvscope_probe import wire

    endpoint = f"ipc://{tmp_path}/probe.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(endpoint)
    env = {**os.environ, plugin.ENV_ENDPOINT: endpoint, "KVSCOPE_PROBE_FLUSH_S": "1.0"}
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        recorded = int(out.stdout.split()[-1])
        seqs: list[int] = []
        while pull.poll(1000):
            frame = wire.decode(pull.recv_multipart())
            if frame.records and not isinstance(frame.records[0], wire.Heartbeat):
                seqs += range(frame.first_seq, frame.first_seq + len(frame.records))
            assert frame.dropped == 0
    finally:
        pull.close(0)
    assert recorded > 50  # steps, the hello and keyframes
    assert sorted(seqs) == list(range(recorded))


STOPPING = """
import os, sys
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope.twin.engine import Twin
from kvscope_probe import plugin
plugin.register()
twin = Twin(TwinConfig(num_blocks=4096, max_num_seqs=128, max_num_batched_tokens=4096), seed=3)
twin.run(generate(WorkloadSpec(n_requests=1000, seed=1)))
print(twin.scheduler._kvscope.seq, flush=True)
plugin.stop_all(5.0)
os._exit(0)
"""

READER = """
import json, sys, zmq
from kvscope_probe import wire
pull = zmq.Context.instance().socket(zmq.PULL)
pull.bind(sys.argv[1])
poller = zmq.Poller()
poller.register(pull, zmq.POLLIN)
poller.register(sys.stdin, zmq.POLLIN)
print("ready", flush=True)
seqs, dropped, size, want = set(), 0, 0, None
while want is None or len(seqs) < want:  # want: the records the engine made (stdin)
    ready = dict(poller.poll(120_000 if want is None else 5000))
    if not ready:
        break
    if pull in ready:
        parts = pull.recv_multipart()
        size += sum(map(len, parts))
        frame = wire.decode(parts)
        dropped += frame.dropped
        if frame.records and not isinstance(frame.records[0], wire.Heartbeat):
            seqs.update(range(frame.first_seq, frame.first_seq + len(frame.records)))
    if sys.stdin.fileno() in ready:
        want = int(sys.stdin.readline())
print(json.dumps({"seqs": sorted(seqs), "dropped": dropped, "bytes": size}), flush=True)
"""


def test_a_stopped_probe_delivers_its_queued_frames_before_the_process_ends(
        tmp_path: Any) -> None:
    """A process that stops the probe and ends at once (``os._exit``, as a forked engine
    may) while its sidecar is not reading: the frames the probe's socket still queues go
    out once the sidecar reads again, within the stop's budget, instead of dying with
    libzmq's I/O thread (709 of 1,235 records arrived so). The frames (~0.8 MB) outgrow
    what the kernel's socket buffer holds for a reader that is stopped, and the sidecar
    resumes 0.3 s after the stop began, inside its 5 s."""
    import json
    import os
    import signal
    import subprocess

    endpoint = f"ipc://{tmp_path}/probe.sock"
    reader = subprocess.Popen([sys.executable, "-c", READER, endpoint],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        env = {**os.environ, plugin.ENV_ENDPOINT: endpoint, "KVSCOPE_PROBE_FLUSH_S": "60"}
        child = subprocess.Popen([sys.executable, "-c", STOPPING], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert child.stdout is not None
        line = child.stdout.readline()  # every step run; the ring holds them all (60 s)
        reader.send_signal(signal.SIGSTOP)  # a sidecar that does not read for a moment
        time.sleep(0.3)
        reader.send_signal(signal.SIGCONT)
        assert child.wait(60) == 0
        recorded = int(line.split()[-1])
        assert reader.stdin is not None
        reader.stdin.write(f"{recorded}\n")
        reader.stdin.flush()
        got = json.loads(reader.stdout.readline())
    finally:
        reader.send_signal(signal.SIGCONT)
        reader.kill()
        reader.wait()
    assert recorded > 1000 and got["bytes"] > 400_000
    assert got["dropped"] == 0
    assert got["seqs"] == list(range(recorded)), (len(got["seqs"]), recorded, got["bytes"])
