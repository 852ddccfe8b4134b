"""Per-engine identity and presence in the Hub: engines kept apart by (server, engine),
collisions kept apart and reported, heartbeats keeping an idle engine connected, a dead
engine process read as gone, and /readyz saying which."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import msgspec
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvscope.sidecar.exposition.metrics import KVScopeCollector
from kvscope.sidecar.http.app import create_app
from kvscope.state.hub import Hub
from kvscope_probe import identity, wire
from tests.unit.test_wire import hello, step


def kf(h: wire.Hello) -> wire.Keyframe:
    return wire.Keyframe(hello=h, states=bytes([3] + [0] * (h.num_blocks - 1)), tables={},
                         tokens={})


def send(hub: Hub, h: wire.Hello, records: list[wire.Record], first_seq: int) -> bool:
    f = wire.Frame(engine=h.engine, session=h.session, first_seq=first_seq, dropped=0,
                   faults=0, records=records)
    return hub.accept(wire.encode(f))


def beat(hub: Hub, engine: str, session: str, since: float = 1.0) -> bool:
    f = wire.Frame(engine=engine, session=session, first_seq=99, dropped=2, faults=1,
                   records=[wire.Heartbeat(ts=1.0, since_step_s=since)])
    return hub.accept(wire.encode(f))


def preempt(victim: str) -> wire.Preemption:
    return wire.Preemption(victim, 1, 0, 8, 0, 0, "r", 0, 1, "fcfs", "kv_full", 1.0)


def test_two_servers_with_engine_0_are_two_engines_with_their_own_counts() -> None:
    hub = Hub()
    a = hello(session="sa", server="127.0.0.1:8001", dp_rank=0)
    b = hello(session="sb", server="127.0.0.1:8002", dp_rank=0)
    assert send(hub, a, [a, step(), kf(a)], 0) and send(hub, b, [b, step(), kf(b)], 0)
    for i in range(3):
        assert send(hub, a, [step(preemptions=[preempt(f"a{i}")], preempted=[f"a{i}"])], 3 + i)
    assert send(hub, b, [step(preemptions=[preempt("b")], preempted=["b"])], 3)
    assert sorted(hub.engines) == ["127.0.0.1:8001/0", "127.0.0.1:8002/0"]
    assert hub.engines["127.0.0.1:8001/0"].counters.preemptions["kv_full"] == 3
    assert hub.engines["127.0.0.1:8002/0"].counters.preemptions["kv_full"] == 1
    assert not hub.collisions and hub.rejected == {}
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub))
    for server, n in (("127.0.0.1:8001", 3), ("127.0.0.1:8002", 1)):
        assert reg.get_sample_value("vllm_scheduler_preempted_requests_total", {
            "server": server, "engine": "0", "model": "tiny", "reason": "kv_full"}) == n


def test_two_live_probes_claiming_one_identity_are_kept_apart_and_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    hub = Hub()
    a = hello(session="sa", server="gpu", pid=100)
    b = hello(session="sb", server="gpu", pid=200)
    send(hub, a, [a, step(), kf(a)], 0)
    with caplog.at_level(logging.WARNING, logger="kvscope.sidecar"):
        send(hub, b, [b, step(), kf(b)], 0)
    assert sorted(hub.engines) == ["gpu#200/0", "gpu/0"]
    assert hub.engines["gpu/0"].hello.session == "sa"  # the first holder keeps its name
    assert hub.collisions == {("gpu", "0"): 1}
    assert "two live probes claim server 'gpu' engine '0' (pids 100 and 200)" in caplog.text
    send(hub, a, [step(preemptions=[preempt("x")], preempted=["x"])], 3)
    assert hub.engines["gpu/0"].counters.preemptions["kv_full"] == 1
    assert hub.engines["gpu#200/0"].counters.preemptions["kv_full"] == 0
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub))
    assert reg.get_sample_value("kvscope_engine_identity_collisions_total",
                                {"server": "gpu", "engine": "0"}) == 1
    assert reg.get_sample_value("kvscope_probe_connected",
                                {"server": "gpu#200", "engine": "0", "model": "tiny"}) == 1


def test_heartbeats_keep_an_idle_engine_connected_and_skip_the_sequence() -> None:
    hub = Hub(health_timeout_s=0.3)
    h = hello(server="s:1")
    send(hub, h, [h, step(), kf(h)], 0)
    st = hub.engines["s:1/0"]
    assert hub.state_of(st) == "active"
    for _ in range(5):  # 0.5 s of heartbeats, longer than the timeout
        time.sleep(0.1)
        assert beat(hub, "0", "s1")
    assert hub.state_of(st) == "idle"
    assert (st.probe_dropped, st.probe_faults) == (2, 1)  # carried by the heartbeat
    assert send(hub, h, [step()], 3)  # first_seq 99 in the heartbeats was no gap
    assert st.counters.gaps == 0 and hub.state_of(st) == "active"
    # The heartbeat reported a new probe fault: the ledger is stale until a keyframe (the
    # probe repairs its mirror and sends one), never shown as checked meanwhile.
    assert not st.ledger.synced
    assert send(hub, h, [kf(h)], 4) and st.ledger.synced and st.counters.gaps == 0
    time.sleep(0.4)
    assert hub.state_of(st) == "silent"
    assert hub.heartbeats == 5


NOW_GAUGES = ("vllm_scheduler_free_blocks", "vllm_scheduler_total_blocks",
              "vllm_scheduler_used_blocks", "vllm_scheduler_kv_block_usage_ratio",
              "vllm_scheduler_running_requests", "vllm_scheduler_waiting_requests",
              "vllm_scheduler_waiting_head_never_fits",
              "vllm_scheduler_token_budget_utilization")
"""Gauges of what an engine's pool and queues hold now."""


def test_a_silent_engine_exports_no_figure_of_its_pool_or_queues_until_heard() -> None:
    """A silent engine's last pool figures stayed exported (and in every fleet sum) until
    the hub forgot it an hour later: free blocks of a pool nobody hears, or that no longer
    exists. Its counters and its health stay; the gauges come back when it is heard."""
    hub = Hub(health_timeout_s=0.3)
    h = hello(server="s:1")
    send(hub, h, [h, step(running=2, waiting=1), kf(h)], 0)
    st = hub.engines["s:1/0"]
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub))
    lv = {"server": "s:1", "engine": "0", "model": "tiny"}

    def now_gauges() -> dict[str, float | None]:
        return {g: reg.get_sample_value(g, lv) for g in NOW_GAUGES}

    heard = now_gauges()
    assert heard["vllm_scheduler_free_blocks"] == 7
    assert heard["vllm_scheduler_running_requests"] == 2
    assert None not in heard.values()
    time.sleep(0.4)
    assert hub.state_of(st) == "silent"
    assert now_gauges() == dict.fromkeys(NOW_GAUGES)
    assert reg.get_sample_value("vllm_scheduler_steps_total", lv) == 1
    assert reg.get_sample_value("kvscope_probe_state", {**lv, "state": "silent"}) == 1
    assert reg.get_sample_value("kvscope_ledger_synced", lv) == 1
    quiet = wire.Frame(engine="0", session="s1", first_seq=3, dropped=0, faults=0,
                       records=[wire.Heartbeat(ts=2.0, since_step_s=1.0)])
    assert hub.accept(wire.encode(quiet))  # heard again, idle: its pool as its last step left it
    assert hub.state_of(st) == "idle" and now_gauges() == heard


def test_a_heartbeat_mixed_with_records_is_refused() -> None:
    hub = Hub()
    h = hello()
    assert not send(hub, h, [h, wire.Heartbeat(1.0, 0.0)], 0)
    assert hub.rejected == {"invalid": 1} and not hub.engines


def test_heartbeats_of_an_unknown_session_count_as_connected_until_its_hello() -> None:
    hub = Hub(health_timeout_s=30)
    c = TestClient(create_app(hub, CollectorRegistry()))
    assert c.get("/readyz").status_code == 503
    assert beat(hub, "0", "late")  # the sidecar restarted while the engine idles
    r = c.get("/readyz")
    assert r.status_code == 200
    (e,) = r.json()["engines"]
    assert (e["key"], e["engine"], e["session"], e["state"], e["heartbeats"]) == (
        None, "0", "late", "idle", 1)
    h = hello(session="late", server="s:1")
    send(hub, h, [h, step(), kf(h)], 0)  # its next step brings the hello
    (e,) = c.get("/readyz").json()["engines"]
    assert (e["key"], e["state"], e["heartbeats"]) == ("s:1/0", "active", 1)
    assert not hub.pending


def test_a_dead_engine_process_reads_gone_and_readyz_says_which() -> None:
    hub = Hub(health_timeout_s=30)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        dead = hello(session="sd", server="s:1", pid=child.pid,
                     started=identity.process_start_time(child.pid))
        live = hello(session="sl", server="s:2", pid=12345, started=0.0)  # unseen: unchecked
        send(hub, dead, [dead, step(), kf(dead)], 0)
        send(hub, live, [live, step(), kf(live)], 0)
        c = TestClient(create_app(hub, CollectorRegistry()))
        states = {e["key"]: (e["state"], e["pid_checked"])
                  for e in c.get("/readyz").json()["engines"]}
        assert states == {"s:1/0": ("active", True), "s:2/0": ("active", False)}
        child.kill()
        child.wait()
        r = c.get("/readyz")
        states = {e["key"]: e["state"] for e in r.json()["engines"]}
        assert states == {"s:1/0": "gone", "s:2/0": "active"}
        assert r.status_code == 200  # one connected, none silent: a gone engine is not silent
        reg = CollectorRegistry()
        reg.register(KVScopeCollector(hub))
        lv = {"server": "s:1", "engine": "0", "model": "tiny"}
        assert reg.get_sample_value("kvscope_probe_state", {**lv, "state": "gone"}) == 1
        assert reg.get_sample_value("kvscope_probe_connected", lv) == 0
        assert reg.get_sample_value("vllm_scheduler_free_blocks", lv) is None  # no pool now
        # the engine restarted: a new session under its identity replaces the gone state
        again = hello(session="s2", server="s:1", pid=child.pid + 1)
        send(hub, again, [again, step(), kf(again)], 0)
        assert hub.engines["s:1/0"].hello.session == "s2" and not hub.collisions
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_hello_of_an_older_probe_decodes_with_no_identity() -> None:
    h = hello()
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(h))
    old = msgspec.msgpack.encode(fields[:-3])  # a Hello without server, dp_rank, started
    back = msgspec.msgpack.decode(old, type=wire.Hello)
    assert (back.server, back.dp_rank, back.started, back.engine) == ("", -1, 0.0, "0")


def test_reconciliation_picks_the_server_at_the_vllm_url() -> None:
    from kvscope.sidecar.exposition.vllm_metrics import VllmScraper, parse
    from tests.unit.test_vllm_metrics import TEXT  # vLLM's engine "0": 25 preemptions

    hub = Hub()
    for session, port in (("sa", 8001), ("sb", 8002)):
        h = hello(session=session, server=f"127.0.0.1:{port}")
        send(hub, h, [h, step(), kf(h)], 0)
    scraper = VllmScraper("http://127.0.0.1:8002")
    scraper.latest = parse(TEXT)
    reg = CollectorRegistry()
    reg.register(KVScopeCollector(hub, vllm=scraper))
    diff = "kvscope_reconciliation_preemptions_diff"
    at = {"engine": "0", "model": "tiny"}
    assert reg.get_sample_value(diff, {**at, "server": "127.0.0.1:8002"}) == -25
    assert reg.get_sample_value(diff, {**at, "server": "127.0.0.1:8001"}) is None
    assert reg.get_sample_value("kvscope_engine_coarse", {**at, "server": "127.0.0.1:8002"}) \
        is None  # probed, so not coarse
