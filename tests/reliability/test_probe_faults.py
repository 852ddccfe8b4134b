"""Property 1: the probe never raises into vLLM, whatever breaks on its sending side.

Building frames (``sender.make_frame``), encoding them (``wire.encode``) and the ZMQ send
fail, for 10,000 steps of vLLM's real scheduler streaming to a real receiver. No
exception reaches the scheduler, the run is step for step the run without the probe, and
every record is either received, or dropped and counted.

The faults are tied to records, not to calls: a seeded set of record sequence numbers,
at least ``MAX_BATCH`` apart, each with the fault its frame meets. A frame holds at most
``MAX_BATCH`` consecutive records, so each chosen record is in a frame of its own and
every fault fires exactly once, however the sender happens to batch: the counts are
exact, not a floor that timing can miss.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvscope.sidecar.ingest.receiver import Receiver
from kvscope.state.hub import Hub
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin, sender, wire
from kvscope_probe.recorder import MAX_FAULTS, Recorder

pytestmark = [pytest.mark.reliability, pytest.mark.twin]

Twin = pytest.importorskip("kvscope.twin.engine").Twin

SPEC = WorkloadSpec(n_requests=400, seed=1)
STEPS = 10_000


KINDS = ("make_frame", "encode", "send_again", "send_error")
WINDOW = sender.MAX_BATCH + 32


class Injector:
    """Raises at the records it chose (seeded), once each; counts what it raised."""

    def __init__(self, seed: int, n_records: int) -> None:
        rng = random.Random(seed)
        self.chosen = {w + rng.randrange(WINDOW - sender.MAX_BATCH): KINDS[i % len(KINDS)]
                       for i, w in enumerate(range(0, n_records, WINDOW))}
        self.raised: dict[str, int] = {}

    def at(self, where: str, first: int, n: int, exc: BaseException) -> None:
        """Raise ``exc`` when a record chosen for ``where`` is in [first, first + n)."""
        for seq in range(first, first + n):
            if self.chosen.get(seq) == where:
                self.raised[where] = self.raised.get(where, 0) + 1
                raise exc

    def expected(self, below: int) -> dict[str, int]:
        """The faults the records numbered below ``below`` must have met."""
        counts: dict[str, int] = {}
        for seq, kind in self.chosen.items():
            if seq < below:
                counts[kind] = counts.get(kind, 0) + 1
        return counts


class FlakySocket:
    """A real ZMQ PUSH socket whose sends fail for the chosen records: EAGAIN (a full
    queue, the ordinary drop path) or another ZMQError (a broken socket)."""

    def __init__(self, sock: Any, inj: Injector) -> None:
        self._sock, self._inj = sock, inj

    def send_multipart(self, parts: Any, *args: Any, **kwargs: Any) -> Any:
        frame = wire.decode(parts)
        span = (frame.first_seq, len(frame.records))
        self._inj.at("send_again", *span, zmq.Again())
        self._inj.at("send_error", *span, zmq.ZMQError(zmq.EFSM, "injected"))
        return self._sock.send_multipart(parts, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def run(endpoint: str | None) -> tuple[Any, list[Any], Any]:
    assert plugin.enable(endpoint)
    twin = Twin(TwinConfig(num_blocks=48), seed=1)
    trail: list[Any] = []

    def on_step(_i: int, out: Any) -> None:
        trail.append((tuple(sorted(out.num_scheduled_tokens.items())),
                      tuple(sorted(out.preempted_req_ids)), tuple(sorted(out.finished_req_ids))))
        if endpoint is not None:
            time.sleep(0.0002)  # an engine step takes milliseconds; let the sender run

    result = twin.run(generate(SPEC), on_step=on_step, max_steps=STEPS)
    return result, trail, twin.scheduler.__dict__.get("_kvscope")


def inject_faults(monkeypatch: pytest.MonkeyPatch, inj: Injector) -> None:
    """``sender.make_frame``, ``wire.encode`` and the sender's socket fail where ``inj``
    chose, and otherwise do what they always do."""
    real_make, real_encode, real_socket = sender.make_frame, wire.encode, sender.Sender._socket

    def make_frame(rec: Recorder, first: int, items: list[Any], *args: Any) -> wire.Frame:
        inj.at("make_frame", first, len(items), RuntimeError("injected in make_frame"))
        return real_make(rec, first, items, *args)

    def encode(frame: wire.Frame) -> list[bytes]:
        inj.at("encode", frame.first_seq, len(frame.records), ValueError("injected in encode"))
        return real_encode(frame)

    monkeypatch.setattr(sender, "make_frame", make_frame)
    monkeypatch.setattr(wire, "encode", encode)
    monkeypatch.setattr(sender.Sender, "_socket",
                        lambda self: FlakySocket(real_socket(self), inj))


def count_pool_scans(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """``{"n": full scans of the pool by the Recorder}``, counting from now."""
    scans = {"n": 0}
    real_scan = Recorder._scan_states

    def counted_scan(self: Recorder) -> bytearray:
        scans["n"] += 1
        return real_scan(self)

    monkeypatch.setattr(Recorder, "_scan_states", counted_scan)
    return scans


def counting_hub() -> tuple[Hub, dict[str, int]]:
    """A Hub that counts the frames it rejects and the records they held."""
    hub = Hub()
    in_rejected = {"frames": 0, "records": 0}
    accept = hub.accept

    def counting_accept(parts: list[bytes]) -> bool:
        ok = accept(parts)
        if not ok:
            in_rejected["frames"] += 1
            in_rejected["records"] += len(wire.decode(parts).records)
        return ok

    hub.accept = counting_accept  # type: ignore[method-assign]
    return hub, in_rejected


def run_streaming(tmp_path: Path, hub: Hub,
                  in_rejected: dict[str, int]) -> tuple[Any, list[Any], Recorder]:
    """``run`` with the probe streaming to a real Receiver into ``hub``, until every record
    the probe produced is received, rejected or dropped (or the deadlines pass)."""
    endpoint = f"ipc://{tmp_path}/p.sock"
    rx = Receiver(hub, [endpoint])
    rx.bind()
    rx.start()
    try:
        faulty, trail, rec = run(endpoint)
        deadline = time.monotonic() + 30  # let the sender drain the ring before it stops
        while rec.ring and time.monotonic() < deadline:
            time.sleep(0.05)
        plugin.stop_all()
        assert isinstance(rec, Recorder)
        deadline = time.monotonic() + 10
        while (hub.records + in_rejected["records"] + rec.ring_dropped + rec.send_dropped
               < rec.seq and time.monotonic() < deadline):
            time.sleep(0.05)
    finally:
        rx.stop()
    return faulty, trail, rec


def test_faults_while_encoding_and_sending_never_reach_the_scheduler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    baseline, base_trail, off = run(None)
    assert baseline.steps == STEPS and not getattr(off, "enabled", False)
    inj = Injector(seed=11, n_records=STEPS)
    inject_faults(monkeypatch, inj)
    scans = count_pool_scans(monkeypatch)
    hub, in_rejected = counting_hub()

    faulty, trail, rec = run_streaming(tmp_path, hub, in_rejected)

    injected = sum(inj.raised.values())
    contained = injected - inj.raised.get("send_again", 0)  # EAGAIN is a drop, not a fault
    dropped = rec.ring_dropped + rec.send_dropped
    print(f"\nproperty 1: {faulty.steps} steps, {injected} faults injected {inj.raised}, "
          f"Recorder.faults={rec.faults}, records produced={rec.seq} "
          f"received={hub.records} dropped={dropped} (ring {rec.ring_dropped}, "
          f"send {rec.send_dropped}), in rejected frames={in_rejected}, pool scans={scans}")
    # no exception reached the scheduler, and it did exactly what it does without the probe
    assert (faulty.steps, faulty.finished, faulty.preemptions, faulty.scheduled_tokens) == (
        baseline.steps, baseline.finished, baseline.preemptions, baseline.scheduled_tokens)
    assert trail == base_trail
    # every chosen record met its fault exactly once; each was contained and counted
    assert rec.ring_dropped == 0  # no chosen record vanished before reaching the sender
    assert rec.seq > STEPS  # a record a step, and the hello: every chosen record was made
    assert inj.raised == inj.expected(STEPS)
    assert set(inj.raised) == set(KINDS)
    # the injector stays below MAX_FAULTS by construction, so the probe must stay on
    assert contained == sum(n for k, n in inj.expected(STEPS).items() if k != "send_again")
    assert contained < MAX_FAULTS and rec.enabled
    assert rec.faults == contained
    # every record is accounted for: received, or dropped and counted
    assert rec.seq == hub.records + in_rejected["records"] + dropped
    st = hub.engines[rec.hello.engine]
    assert st.counters.gaps >= 1
    assert st.probe_faults == rec.faults  # frames after the last fault carry its count
    # a failure on the sender thread never makes the engine thread rescan the pool
    assert scans["n"] == 1
