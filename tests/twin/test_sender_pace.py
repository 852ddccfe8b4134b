"""The probe's sender wakes once per flush interval and keeps what it queues bounded in bytes.

Its cost is per wakeup (each takes the GIL from the engine thread several times), so the
interval, not the step rate, sets how often it runs: vLLM's real scheduler steps as fast as
it can on this thread while a real ``Sender`` streams its records to a PULL socket.
"""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

import pytest
import zmq

from kvscope_probe import sender, wire
from tests.twin.streaming import stream

pytestmark = pytest.mark.twin


def test_a_frame_stops_at_its_byte_bound_and_always_carries_one_record() -> None:
    sizes = [300_000, 400_000, 300_000, 100, 2_000_000, 10, 10]
    ring = SimpleNamespace(ring=deque(
        (i, b"x" * n) for i, n in enumerate(sizes)), popped_bytes=0)
    frames = []
    while ring.ring:
        first, items = sender.pop_run(ring)  # type: ignore[arg-type]
        frames.append((first, [len(b) for b in items]))
    # 300k + 400k + 300k = 1.0e6 <= 1 MiB, the next 100 bytes too; the 2 MB record goes alone
    assert frames == [(0, [300_000, 400_000, 300_000, 100]), (4, [2_000_000]), (5, [10, 10])]
    assert ring.popped_bytes == sum(sizes)
    assert sender.DEFAULT_HWM * sender.MAX_FRAME_BYTES == 128 << 20


def test_the_sender_wakes_once_per_interval_whatever_the_step_rate(tmp_path) -> None:
    flush_s = 0.1
    run = stream(tmp_path, flush_s=flush_s)
    rec, snd, frames, steps, busy_s = run.rec, run.snd, run.frames, run.steps, run.busy_s
    # Heartbeats are the sender's own records, sent when nothing went out for HEARTBEAT_S
    # (a CI worker starved this run for 2 s once: 2,038 records arrived for 2,037 pushed)
    beats = [f for f in frames if any(isinstance(r, wire.Heartbeat) for r in f.records)]
    got = [r for f in frames if f not in beats for r in f.records]
    assert len(got) == rec.seq and rec.ring_dropped == rec.send_dropped == 0
    assert len(beats) == snd.heartbeats and all(len(f.records) == 1 for f in beats)
    assert [f.first_seq for f in frames] == sorted(f.first_seq for f in frames)
    # one wakeup per interval while the engine stepped far faster (plus the interval the
    # run started in and the one the stop cut short); a wakeup splits what it found into
    # frames of MAX_BATCH records
    print(f"\n{steps} records in {busy_s:.2f} s, {snd.wakeups} wakeups, {len(frames)} frames")
    assert busy_s > 3 * flush_s and steps > 10 * busy_s / flush_s, (steps, busy_s)
    assert snd.wakeups <= busy_s / flush_s + 2, (snd.wakeups, busy_s)
    assert len(frames) - len(beats) <= len(got) / sender.MAX_BATCH + snd.wakeups + 1
    assert max(len(f.records) for f in frames) <= sender.MAX_BATCH


def test_sending_starts_no_python_thread_besides_the_sender(tmp_path) -> None:
    """pyzmq frees zero-copy messages of 64 KiB or more on a Python thread of its own,
    which would wake for every frame and take the GIL from the engine thread."""
    from kvscope_probe import transport

    endpoint = f"ipc://{tmp_path}/gc.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(endpoint)
    push = transport.push_socket(endpoint, hwm=4)
    assert transport.await_connection(push)
    before = {t.ident for t in threading.enumerate()}
    for _ in range(3):
        assert transport.send(push, [b"x" * (1 << 20)], 1000)
        assert pull.recv_multipart() == [b"x" * (1 << 20)]
    push.close(0)
    pull.close(0)
    started = [t.name for t in threading.enumerate() if t.ident not in before]
    assert started == []
