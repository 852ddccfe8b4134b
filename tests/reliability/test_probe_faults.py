"""Property 1: the probe never raises into vLLM, whatever breaks on its sending side.

Encoding records (``sender.to_record``), encoding frames (``wire.encode``) and the ZMQ send
fail at random, seeded, for 10,000 steps of vLLM's real scheduler streaming to a real
receiver. No exception reaches the scheduler, the run is step for step the run without the
probe, and every record is either received, or dropped and counted.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvscope.sidecar.hub import Hub
from kvscope.sidecar.receiver import Receiver
from kvscope.twin import TwinConfig, WorkloadSpec, generate
from kvscope_probe import plugin, sender, wire
from kvscope_probe.recorder import MAX_FAULTS, Recorder

pytestmark = [pytest.mark.reliability, pytest.mark.twin]

Twin = pytest.importorskip("kvscope.twin.engine").Twin

SPEC = WorkloadSpec(n_requests=400, seed=1)
STEPS = 10_000


class Injector:
    """Raises at random (seeded) from the call sites it wraps; counts what it raised."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.raised: dict[str, int] = {}

    def maybe(self, where: str, p: float, exc: BaseException) -> None:
        if self.rng.random() < p:
            self.raised[where] = self.raised.get(where, 0) + 1
            raise exc


class FlakySocket:
    """A real ZMQ PUSH socket whose sends sometimes fail: EAGAIN (a full queue, the
    ordinary drop path) or another ZMQError (a broken socket)."""

    def __init__(self, sock: Any, inj: Injector) -> None:
        self._sock, self._inj = sock, inj

    def send_multipart(self, parts: Any, *args: Any, **kwargs: Any) -> Any:
        self._inj.maybe("send_again", 0.03, zmq.Again())
        self._inj.maybe("send_error", 0.02, zmq.ZMQError(zmq.EFSM, "injected"))
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


def test_faults_while_encoding_and_sending_never_reach_the_scheduler(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    baseline, base_trail, off = run(None)
    assert baseline.steps == STEPS and not getattr(off, "enabled", False)

    inj = Injector(seed=11)
    real_to_record, real_encode, real_socket = sender.to_record, wire.encode, sender.Sender._socket

    def to_record(item: tuple[Any, ...]) -> wire.Record:
        inj.maybe("to_record", 0.01, RuntimeError("injected in to_record"))
        return real_to_record(item)

    def encode(frame: wire.Frame) -> list[bytes]:
        inj.maybe("encode", 0.03, ValueError("injected in wire.encode"))
        return real_encode(frame)

    monkeypatch.setattr(sender, "to_record", to_record)
    monkeypatch.setattr(wire, "encode", encode)
    monkeypatch.setattr(sender.Sender, "_socket",
                        lambda self: FlakySocket(real_socket(self), inj))
    scans = {"n": 0}
    real_scan = Recorder._scan_states

    def counted_scan(self: Recorder) -> bytearray:
        scans["n"] += 1
        return real_scan(self)

    monkeypatch.setattr(Recorder, "_scan_states", counted_scan)

    endpoint = f"ipc://{tmp_path}/p.sock"
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
    rx = Receiver(hub, [endpoint])
    rx.bind()
    rx.start()
    try:
        faulty, trail, rec = run(endpoint)
        plugin.stop_all()
        assert isinstance(rec, Recorder)
        deadline = time.monotonic() + 10
        while (hub.records + in_rejected["records"] + rec.ring_dropped + rec.send_dropped
               < rec.seq and time.monotonic() < deadline):
            time.sleep(0.05)
    finally:
        rx.stop()

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
    # every injected fault was contained and counted; the probe stayed on
    assert set(inj.raised) == {"to_record", "encode", "send_again", "send_error"}
    assert 50 <= contained < MAX_FAULTS and rec.enabled
    assert rec.faults == contained
    # every record is accounted for: received, or dropped and counted
    assert rec.seq == hub.records + in_rejected["records"] + dropped
    st = hub.engines[rec.hello.engine]
    assert st.counters.gaps >= 1 and st.probe_faults <= rec.faults
    # a failure on the sender thread never makes the engine thread rescan the pool
    assert scans["n"] == 1
