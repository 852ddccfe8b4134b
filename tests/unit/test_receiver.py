"""The receiver, in process with real ZMQ sockets: a queue bounded in bytes while the hub is
stalled (every frame ingested or refused and counted, none lost unseen), CURVE on tcp with
every kind of unauthenticated peer refused by reason, and ipc sockets private to the user."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvscope.localvllm.server import free_port
from kvscope.sidecar.ingest import receiver as receiver_module
from kvscope.sidecar.ingest.receiver import FrameQueue, Receiver, socket_dir_problem
from kvscope.state.hub import Hub
from kvscope_probe import transport, wire
from tests.unit.test_wire import hello, step

SECRET = b"unit-test-secret-0123456789abcdef"


def wait(what: str, check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def keyframe_frame(seq: int, n_blocks: int = 4096) -> list[bytes]:
    session = f"s{n_blocks}"  # one probe session per pool size
    h = hello(num_blocks=n_blocks, session=session)
    kf = wire.Keyframe(hello=h, states=bytes([3] + [0] * (n_blocks - 1)), tables={}, tokens={})
    return wire.encode(wire.Frame(engine="0", session=session, first_seq=seq, dropped=0,
                                  faults=0, records=[kf]))


@pytest.fixture
def tcp_receiver() -> Iterator[tuple[Receiver, Hub, str]]:
    hub = Hub()
    ep = f"tcp://127.0.0.1:{free_port()}"
    rx = Receiver(hub, [ep], secret=SECRET)
    rx.bind()
    rx.start()
    rx.ready.wait(5)
    try:
        yield rx, hub, ep
    finally:
        rx.stop()


def test_the_queue_holds_at_most_its_bytes() -> None:
    q = FrameQueue(max_bytes=100)
    assert q.put_all([[b"x" * 60], [b"y" * 60], [b"z" * 40]]) == 1  # y does not fit
    assert q.bytes == 100 and len(q) == 2
    assert q.get(0.1) == [b"x" * 60] and q.bytes == 40
    assert q.put_all([[b"w" * 500]]) == 1
    q.get(0.1)
    assert q.put_all([[b"w" * 500]]) == 0  # one frame larger than the bound still passes, alone
    assert q.get(0.01) == [b"w" * 500] and q.get(0.01) is None


def test_a_stalled_hub_costs_bounded_memory_and_every_frame_is_counted(tmp_path: Path) -> None:
    hub = Hub()
    ep = f"ipc://{tmp_path}/probe.sock"
    limit = 1 << 20
    rx = Receiver(hub, [ep], buffer_bytes=limit)
    batches: list[int] = []  # bytes handed to the queue in one go
    put_all = rx.queue.put_all
    rx.queue.put_all = lambda batch: (  # type: ignore[method-assign]
        batches.append(sum(len(p) for parts in batch for p in parts)) or put_all(batch))
    rx.bind()
    rx.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(ep)
    sent, peak = 0, 0
    try:
        with hub.lock:  # a scrape that holds the hub: ingestion stops, reading does not
            for seq in range(200):  # 200 keyframes of ~4 KiB and ~100 KiB
                push.send_multipart(keyframe_frame(seq, 4096 if seq % 2 else 100_000))
                sent += 1
                peak = max(peak, rx.queue.bytes)
            wait("the receiver to read every frame", lambda: rx.received == sent)
            peak = max(peak, rx.queue.bytes)
        wait("the hub to ingest what was queued", lambda: not len(rx.queue))
        wait("every frame accounted for",
             lambda: hub.frames + hub.rejected["buffer_full"] == sent)
    finally:
        push.close(0)
        rx.stop()
    assert peak <= limit
    # what was read in one go was handed over a MiB or so at a time, not held whole
    biggest = max(len(p) for p in keyframe_frame(0, 100_000))
    assert sum(batches) > 4 * receiver_module.BATCH_BYTES
    assert max(batches) < receiver_module.BATCH_BYTES + biggest
    assert hub.rejected["buffer_full"] > 0 and hub.frames > 0
    print(f"stalled hub: {sent} frames sent, {hub.frames} ingested, "
          f"{hub.rejected['buffer_full']} refused as buffer_full, peak queue {peak} bytes "
          f"(limit {limit})")


def test_frames_that_arrive_while_the_receiver_waits_are_taken_together(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wake-up of an idle thread costs more than a frame (benchmarks/README.md,
    thirteenth pass): once the socket thread has read every waiting message it lets the
    next ones gather for TAKE_EVERY_S, then both threads take them in one go; stopping
    does not wait out the window, and what arrived meanwhile is ingested, not dropped."""
    monkeypatch.setattr(receiver_module, "TAKE_EVERY_S", 0.5)  # room for a loaded machine
    hub = Hub()
    taken: list[tuple[int, float]] = []
    accept = hub.accept

    def timed(parts: list[bytes]) -> None:
        accept(parts)
        taken.append((hub.frames, time.monotonic()))

    monkeypatch.setattr(hub, "accept", timed)
    ep = f"ipc://{tmp_path}/probe.sock"
    rx = Receiver(hub, [ep])
    batches: list[int] = []
    put_all = rx.queue.put_all

    def counted(batch: list[list[bytes]]) -> int:
        batches.append(len(batch))
        return put_all(batch)

    monkeypatch.setattr(rx.queue, "put_all", counted)
    rx.bind()
    rx.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(ep)
    try:
        rx.ready.wait(5)
        push.send_multipart(keyframe_frame(0))
        wait("the first frame taken", lambda: len(taken) == 1)
        for seq in (1, 2, 3):  # three frames 20 ms apart, inside the gathering window
            push.send_multipart(keyframe_frame(seq))
            time.sleep(0.02)
        last_sent = time.monotonic()
        wait("the three taken", lambda: len(taken) == 4)
        assert batches == [1, 3]  # read in one go, handed over in one go
        assert all(t >= last_sent for _, t in taken[1:])  # none was taken on its own
        wait("the receiver to wait again", lambda: rx.received == 4)
        for seq in (4, 5):  # sent while it waits: still in ZMQ's queue when stopping
            push.send_multipart(keyframe_frame(seq))
        time.sleep(0.05)  # in ZMQ's queue (ipc delivers in well under this)
        assert len(taken) == 4
        stopped = time.monotonic()
        rx.stop(5.0)
    finally:
        push.close(0)
        rx.stop()
    assert [n for n, _ in taken] == [1, 2, 3, 4, 5, 6]  # every frame, in order
    assert taken[-1][1] - stopped < 0.5  # stopping does not wait out the window
    assert not rx.is_alive() and not rx._ingest.is_alive()


def test_ipc_endpoints_are_private_to_this_user(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/run/kvscope/probe.sock"
    rx = Receiver(Hub(), [ep])
    rx.bind()
    try:
        path = Path(ep[len("ipc://"):])
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    finally:
        rx.start()
        rx.stop()


def test_a_socket_directory_others_may_write_to_is_refused(tmp_path: Path) -> None:
    """mkdir(exist_ok=True, mode=0o700) keeps an existing directory as it is: a
    /tmp/kvscope-<uid> someone else made first, or one open to all, let another user
    replace the socket and read what the probe sends."""
    me = os.geteuid()
    if me:  # a directory of this user that others may write to (root's are trusted)
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        with pytest.raises(ValueError, match=r"others may write to it \(mode 0777\)"):
            Receiver(Hub(), [f"ipc://{shared}/probe.sock"]).bind()
        assert not (shared / "probe.sock").exists()
    else:  # root: one another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        with pytest.raises(ValueError, match="it belongs to uid 12345"):
            Receiver(Hub(), [f"ipc://{theirs}/probe.sock"]).bind()
        assert not (theirs / "probe.sock").exists()
    other = me + 1 if me else 12345
    assert socket_dir_problem(other, stat.S_IFDIR | 0o700, me) == (
        f"it belongs to uid {other}, who could replace the socket")
    assert socket_dir_problem(other, stat.S_IFLNK | 0o777, me) is not None  # their link
    assert socket_dir_problem(me, stat.S_IFDIR | 0o700, me) is None
    assert socket_dir_problem(me, stat.S_IFDIR | 0o755, me) is None
    assert socket_dir_problem(me, stat.S_IFLNK | 0o777, me) is None  # a link's own mode
    assert socket_dir_problem(0, stat.S_IFDIR | 0o1777, me) is None  # /tmp
    assert socket_dir_problem(0, stat.S_IFDIR | 0o777, me) is None  # a pod's emptyDir
    assert socket_dir_problem(4242, stat.S_IFDIR | 0o777, 4242) == (
        "others may write to it (mode 0777) and could replace the socket; make it 0700")


def test_a_receiver_never_started_leaves_nothing_that_hangs_its_process(
        tmp_path: Path) -> None:
    """Built and dropped (a sidecar that failed to start, a test), or failing to bind, ipc or
    tcp: the next cyclic collection finishes, and so does the process. The receiver made
    its ZMQ context and sockets when built; dropped in a cycle with its ingest thread, the
    context's finaliser waited forever for sockets the collector had not closed yet."""
    code = textwrap.dedent(f"""
        import gc
        from kvscope.sidecar.config import ServeConfig
        from kvscope.sidecar.ingest.receiver import Receiver
        from kvscope.sidecar.server import Sidecar
        from kvscope.state.hub import Hub

        Receiver(Hub(), ["ipc://{tmp_path}/a.sock"])
        Receiver(Hub(), ["tcp://127.0.0.1:{free_port()}"], secret={SECRET!r})
        gc.collect()
        try:
            Receiver(Hub(), ["ipc:///proc/kvscope-nowhere/p.sock"]).bind()
        except OSError:
            pass
        gc.collect()
        Sidecar(ServeConfig(endpoints=("ipc://{tmp_path}/b.sock",), clickhouse_dsn="off",
                            decision_log="off", data_dir="{tmp_path}"))
        gc.collect()
        print("collected")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "collected"), out.stderr[-2000:]


def test_tcp_without_a_secret_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="need the probe secret"):
        Receiver(Hub(), [f"tcp://127.0.0.1:{free_port()}"])


def curve_push(ep: str, server_public: bytes, client: transport.CurveKeys | None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    if client is not None:
        s.curve_serverkey = server_public
        s.curve_publickey = client.client_public
        s.curve_secretkey = client.client_secret
    s.connect(ep)
    return s


def test_only_a_holder_of_the_secret_gets_frames_in(
        tcp_receiver: tuple[Receiver, Hub, str]) -> None:
    rx, hub, ep = tcp_receiver
    right = transport.curve_keys(SECRET)
    other = transport.curve_keys(b"another-secret-0123456789abcdef")
    good = transport.push_socket(ep, hwm=100, secret=SECRET)
    h = hello(server="s:1")
    f = wire.Frame(engine="0", session="s1", first_seq=0, dropped=0, faults=0,
                   records=[h, step(), wire.Keyframe(hello=h, states=bytes([3] + [0] * 7),
                                                     tables={}, tokens={})])
    assert transport.send(good, wire.encode(f), 2000)
    wait("the good probe's engine", lambda: "s:1/0" in hub.engines)
    before = (hub.frames, hub.records, dict(hub.rejected))
    forged = wire.encode(wire.Frame(engine="0", session="s1", first_seq=3, dropped=0, faults=0,
                                    records=[step(preempted=["x"], preemptions=[
                                        wire.Preemption("x", 1, 0, 8, 0, 0, None, None, None,
                                                        "fcfs", "unknown", 1.0)])]))
    host, port = ep[len("tcp://"):].rsplit(":", 1)
    # Each kind of peer alone, and which reasons its refusals count under. A peer without
    # CURVE is refused at the greeting; whichever side notices first decides whether the
    # sidecar sees a mechanism mismatch or a closed connection (protocol).
    kinds = [
        ("no CURVE", lambda: curve_push(ep, right.server_public, None), {"mechanism", "protocol"}),
        ("another secret", lambda: curve_push(ep, other.server_public, other), {"crypto"}),
        ("server key only", lambda: curve_push(ep, right.server_public, other), {"auth"}),
        ("silent", lambda: socket.create_connection((host, int(port))), {"protocol"}),
    ]
    for name, make, reasons in kinds:
        seen = rx.refused()
        peer = make()
        if not isinstance(peer, socket.socket):
            # Queued locally and never delivered; or, when libzmq has no pipe for it at that
            # moment (EAGAIN, seen once with both cores busy), not even queued.
            with contextlib.suppress(zmq.Again):
                peer.send_multipart(forged, flags=zmq.NOBLOCK)
        wait(f"a refusal of the {name} peer", lambda s=seen: rx.refused() != s, 15)
        grew = {r for r, n in rx.refused().items() if n > seen.get(r, 0)}
        assert grew <= reasons, (name, grew)
        peer.close() if isinstance(peer, socket.socket) else peer.close(0)
    # Bytes that are not ZMTP at all (HTTP) are cut off at once: no frame, and libzmq
    # reports no handshake to count.
    web = socket.create_connection((host, int(port)), timeout=10)
    web.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + forged[1])
    with contextlib.suppress(ConnectionResetError):
        while web.recv(4096):  # the sidecar hangs up
            pass
    web.close()
    time.sleep(0.3)
    st = hub.engines["s:1/0"]
    assert (hub.frames, hub.records, dict(hub.rejected)) == before  # nothing reached the hub
    assert st.counters.preemptions == {"kv_full": 0, "priority": 0, "unknown": 0}
    assert st.counters.steps == 1 and rx.gate is not None and rx.gate.accepted == 1
    print(f"refused connection attempts: {rx.refused()}")
    good.close(0)


def test_probes_that_connect_together_are_let_in_together_while_others_stream(
        tcp_receiver: tuple[Receiver, Hub, str]) -> None:
    """Engines often start together (a data-parallel server, a restarted host). A probe
    waits 1 s for its connection, then drops what it cannot send; the socket thread answered
    one ZAP request per wake-up and, while frames flowed, rested TAKE_EVERY_S after each,
    so the eighth of eight probes waited ~2 s (test_many_engines lost records under load)."""
    rx, hub, ep = tcp_receiver
    assert rx.gate is not None
    windows = [0]  # the socket thread's rests after reading (TAKE_EVERY_S each)
    wait_for = rx.stop_event.wait

    def counted(timeout: float | None = None) -> bool:
        windows[0] += timeout == receiver_module.TAKE_EVERY_S
        return wait_for(timeout)

    rx.stop_event.wait = counted  # type: ignore[method-assign]
    streaming = transport.push_socket(ep, hwm=1000, secret=SECRET)
    assert transport.await_connection(streaming)
    h = hello(server="stream:1")
    first = wire.Frame(engine="0", session="s1", first_seq=0, dropped=0, faults=0,
                       records=[h])
    assert transport.send(streaming, wire.encode(first), 2000)
    stop = threading.Event()

    def stream() -> None:  # a frame every 20 ms: the socket thread reads, then rests
        seq = 1
        while not stop.wait(0.02):
            f = wire.Frame(engine="0", session="s1", first_seq=seq, dropped=0, faults=0,
                           records=[step()])
            transport.send(streaming, wire.encode(f), 200)
            seq += 1

    sender = threading.Thread(target=stream, daemon=True)
    sender.start()
    try:
        wait("the socket thread resting between reads", lambda: windows[0] >= 2)
        k = 16
        at = windows[0]
        probes = [transport.push_socket(ep, hwm=100, secret=SECRET) for _ in range(k)]
        wait(f"{k} more probes let in", lambda: rx.gate.accepted == k + 1, 30)
        taken = windows[0] - at
        for p in probes:
            p.close(0)
    finally:
        stop.set()
        sender.join(5)
        streaming.close(0)
    # Their handshakes arrive within milliseconds (spread over a few rests when the
    # machine is loaded): answered together, not one wake-up, and one rest, each.
    print(f"{k} probes let in over {taken} rests of {receiver_module.TAKE_EVERY_S} s")
    assert taken < k // 2, f"{k} probes took {taken} rests of {receiver_module.TAKE_EVERY_S} s"


def test_the_probe_side_refuses_tcp_without_a_secret() -> None:
    with pytest.raises(transport.TransportError, match="KVSCOPE_PROBE_SECRET"):
        transport.push_socket("tcp://127.0.0.1:1", hwm=1, env={})
    with pytest.raises(transport.TransportError, match="at least 24"):
        transport.read_secret({"KVSCOPE_PROBE_SECRET": "short"})


def test_the_secret_comes_from_a_file_and_never_shows(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET.decode() + "\n")
    os.chmod(path, 0o600)
    assert transport.read_secret({"KVSCOPE_PROBE_SECRET_FILE": str(path)}) == SECRET
    keys = transport.curve_keys(SECRET)
    assert SECRET.decode() not in repr(keys) and keys.client_secret.decode() not in repr(keys)
    with pytest.raises(transport.TransportError, match=r"cannot read .*FileNotFoundError"):
        transport.read_secret({"KVSCOPE_PROBE_SECRET_FILE": str(tmp_path / "nope")})


def test_the_middlewares_emitter_authenticates_through_the_same_transport(
        tcp_receiver: tuple[Receiver, Hub, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvscope_probe.emitter import Emitter

    rx, hub, ep = tcp_receiver
    seen: list[wire.Record] = []
    hub.client_listeners.append(seen.append)
    monkeypatch.setenv("KVSCOPE_PROBE_SECRET", SECRET.decode())
    em = Emitter(ep)
    em.emit(wire.ClientStart(request_id="kvs1", ts=1.0, endpoint="completions", model="tiny",
                             client_id="c", user_agent="ua", api_key_sha256="", prompt_sha256="h",
                             prompt_chars=3, max_tokens=4))
    em.emit(wire.ClientEnd(request_id="kvs1", ts=2.0, status=200, duration_s=1.0))
    wait("the client events at the hub", lambda: len(seen) == 2)
    em.close()  # it would go on reconnecting to this receiver after the test stops it
    assert em.dropped == 0 and hub.client_records == 2 and rx.gate is not None
    assert rx.gate.accepted == 1 and not rx.refused()
