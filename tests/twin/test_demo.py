"""`kvscope demo` end to end, headless, as a user runs it (twin engine).

Every layer must have produced data: Prometheus metrics (block gauges in sync, the
preemption count the findings print), ClickHouse rows in every table (read from the
sidecar's own counters while it serves, then from the store once the demo has stopped),
the decision log (one preempt line per preemption), the ``/ui`` page and ``/api/layout``,
and client correlation (every request counted per client, traces joined, a duplicate
flagged). Ctrl-C must stop it with no process left behind, after the run and in the
middle of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from kvscope.demo.findings import SETTLED_TABLES
from kvscope.demo.live import Scrape
from kvscope.demo.workload import DUPLICATE_EVERY
from kvscope.localvllm.server import free_port

pytestmark = pytest.mark.twin

REQUESTS = 100
BLOCKS = 64
FAST = ["--step-ms", "4", "--requests", str(REQUESTS), "--blocks", str(BLOCKS)]
USABLE = BLOCKS - 1  # vLLM keeps block 0 as its null block
TABLES = ("request_traces", "request_events", "scheduler_decisions", "step_stats",
          "layout_snapshots", "client_requests")


class Demo:
    """``python -m kvscope demo`` as a subprocess, its output read line by line."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.data = tmp_path / "demo"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")} | (env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvscope", "demo", "--port", str(self.port),
             "--data-dir", str(self.data), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**env, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"the demo exited before {pattern!r}:\n{self.text()}")
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        pytest.fail(f"no {pattern!r} within {timeout_s:.0f} s:\n{self.text()}")

    def text(self) -> str:
        while not self._q.empty():
            line = self._q.get()
            if line is not None:
                self.lines.append(line)
        return "".join(self.lines)

    def descendants(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def finish(self, timeout_s: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """Stop the demo and every process it started, whatever state a failed test left it
        in: SIGTERM (the demo stops its sidecar and engine), then SIGKILL by PID for any of
        them still there. SIGKILL to the demo alone left its sidecar and vLLM server running
        after a failed CI test."""
        if self.proc.poll() is None:
            kids = self.descendants()  # while they are still the demo's
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            for pid in kids:
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"processes left behind: {alive}"


def stored_rows(chdb_dir: Path) -> dict[str, int]:
    """Rows per table in the demo's store, read by a fresh process (one chDB per process)."""
    script = (
        "import json, sys, clickhouse_connect\n"
        "c = clickhouse_connect.get_client(dsn='chdb://' + sys.argv[1], database='kvscope')\n"
        f"t = {list(TABLES)!r}\n"
        "out = {n: c.query(f'SELECT count() FROM {n}').result_rows[0][0] for n in t}\n"
        "out['preempt'] = c.query(\"SELECT count() FROM scheduler_decisions "
        "WHERE decision = 'preempt'\").result_rows[0][0]\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", script, str(chdb_dir)], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def findings_shown(demo: Demo, text: str) -> int:
    """The preemptions the findings print (checked > 0), once the demo said it is done."""
    shown = int(re.search(r"^  preemptions\s+(\d+) \(", text, re.M).group(1))  # type: ignore[union-attr]
    assert shown > 0, text
    assert f"{REQUESTS}/{REQUESTS} requests answered (0 failed)" in text
    assert f"{demo.base}/ui" in text and "query hourly_preemptions --dsn chdb://" in text
    return shown


def explain_shown(demo: Demo, text: str, http: httpx.Client) -> list[str]:
    """"Why was this one request slow": the demo names the request its decision log shows
    preempted most, the sidecar's explain page of it tells that story (every preemption),
    and the commands it prints for once it has stopped (returned, to run then)."""
    log = [json.loads(ln) for ln in (demo.data / "decisions.jsonl").read_text().splitlines()]
    counts: dict[str, int] = {}
    for d in log:
        if d["event"] == "preempt":
            counts[d["request_id"]] = counts.get(d["request_id"], 0) + 1
    most = max(counts.values())
    m = re.search(r"^  explain  (\S+)   why request (\S+) was slow \(preempted (\d+) times\)",
                  text, re.M)
    assert m is not None, text
    url, rid, n = m.group(1), m.group(2), int(m.group(3))
    assert counts[rid] == n == most
    assert url.startswith(f"{demo.base}/ui/requests/")
    page = http.get(url[len(demo.base):])
    assert page.status_code == 200 and "one request's story" in page.text  # drawn from:
    story = http.get(f"/api/requests/{rid}").json()
    assert [len(r["preemptions"]) for r in story["engine_requests"]] == [n]
    return [ln.strip().split("   ")[0] for ln in text.splitlines()
            if re.match(r"^ {11}\S.* explain .*--dsn ", ln)]


IDLE_POOL = {"total_blocks": USABLE, "free_blocks": USABLE, "used_blocks": 0,
             "max_contiguous_free_blocks": USABLE, "tail_waste_tokens": 0,
             "running_requests": 0, "waiting_requests": 0}
"""The twin's pool once every request has ended: every usable block free (prefix-cached
ones count), one run of them, nothing running or waiting."""


def settled_scrape(http: httpx.Client, timeout_s: float = 20.0) -> Scrape:
    """/metrics once the probe's last records and the clients' last events are in (the
    sidecar waits up to 5 s for a trace's client event), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = Scrape(http.get("/metrics").text)
        joined = m.total("kvscope_client_traces_joined_total")
        idle = all(m.value(f"vllm_scheduler_{g}") == v for g, v in IDLE_POOL.items())
        if (idle and joined == REQUESTS) or time.monotonic() > deadline:
            return m
        time.sleep(0.25)


def assert_nothing_lost(m: Scrape) -> None:
    """Every record the probe made reached the ledger: the exact counts below hold only
    then, and a failure names where records went (the probe's drops, the sidecar's
    refusals by reason, sequence gaps) and what arrived."""
    lost = {"dropped": m.total("kvscope_probe_records_dropped_total"),
            "refused": m.by("kvscope_probe_frames_rejected_total", "reason"),
            "gaps": m.total("kvscope_ledger_gaps_total"),
            "arrived": m.total("vllm_scheduler_requests_arrived_total"),
            "ended": m.total("vllm_scheduler_requests_ended_total")}
    assert lost["dropped"] == lost["gaps"] == 0, lost
    assert not any(lost["refused"].values()), lost  # type: ignore[union-attr]


def assert_prometheus_layer(m: Scrape, shown: int) -> None:
    """Layer 1: block gauges in sync and equal to the idle pool, the preemptions the
    findings print, every request."""
    assert_nothing_lost(m)
    assert m.value("kvscope_ledger_synced") == 1
    gauges = {g: m.value(f"vllm_scheduler_{g}") for g in IDLE_POOL}
    assert gauges == IDLE_POOL
    assert m.total("vllm_scheduler_preempted_requests_total") == shown
    assert m.value("vllm_scheduler_preempted_requests_total", reason="kv_full") == shown
    assert m.total("vllm_scheduler_requests_ended_total") == REQUESTS


def assert_rows_acknowledged(m: Scrape) -> None:
    """Layer 2 (and the layout and decision rows): what ClickHouse acknowledged."""
    rows = m.by("kvscope_sink_rows_written_total", "table")
    assert rows["request_traces"] == REQUESTS and rows["client_requests"] == REQUESTS
    assert all(rows.get(t, 0) > 0 for t in TABLES), rows
    assert m.total("kvscope_sink_rows_dropped_total") == 0


def assert_layout_layer(http: httpx.Client) -> None:
    """Layer 3: the page and its data."""
    ui = http.get("/ui")
    layout = http.get("/api/layout").json()
    engines = http.get("/api/engines").json()["engines"]
    assert ui.status_code == 200 and "<html" in ui.text.lower()
    assert [e["engine"] for e in layout["engines"]] == [engines[0]["engine"]]
    assert layout["engines"][0]["status"] == "ok" and layout["engines"][0]["layout"]


def assert_decision_log(demo: Demo, text: str, shown: int) -> None:
    """Layer 4: one preempt line per preemption, each with the facts to check its cause."""
    log = [json.loads(ln) for ln in (demo.data / "decisions.jsonl").read_text().splitlines()]
    preempts = [d for d in log if d["event"] == "preempt"]
    assert len(preempts) == shown
    assert all(d["blocks_needed"] > d["free_blocks"] for d in preempts)
    assert f"{shown} of {shown} preemptions needed more blocks than were free" in text


def assert_client_layer(m: Scrape) -> None:
    """Layer 5: every request counted per client, traces joined, a duplicate flagged."""
    per_client = m.by("kvscope_client_requests_total", "client")
    assert sum(per_client.values()) == REQUESTS
    assert set(per_client) == {"chat-frontend", "rag-service", "batch-summarizer",
                               "retry-bot"}
    assert m.total("kvscope_client_traces_joined_total") == REQUESTS
    assert m.total("kvscope_client_traces_unjoined_total") == 0
    # the retry bot resends one prompt in DUPLICATE_EVERY within seconds: each is flagged
    assert m.by("kvscope_client_duplicate_requests_total", "client") == {
        "retry-bot": REQUESTS // DUPLICATE_EVERY}
    agents = m.by("kvscope_user_agent_requests_total", "user_agent")
    assert any(a.startswith("retry-bot/0.1 kvscope-client/") for a in agents), agents


def assert_store_rows(stored: dict[str, int], shown: int, text: str) -> None:
    """Once the demo has stopped: every table has rows, a trace and a client row per
    request, a preempt decision per preemption, and the findings' "stored" line gave the
    store's own count of each table whose rows had stopped coming (layout and step rows
    go on while the demo serves; the line once counted the decision log's lines as
    scheduler_decisions rows too, twice the store's)."""
    assert stored["request_traces"] == REQUESTS and stored["client_requests"] == REQUESTS
    assert stored["preempt"] == shown
    assert all(stored[t] > 0 for t in TABLES), stored
    line = next(x for x in text.splitlines() if "stored            ClickHouse rows: " in x)
    said = {t: int(n) for t, n in (p.rsplit(" ", 1) for p in line.split(": ", 1)[1].split(", "))}
    assert {t: said[t] for t in SETTLED_TABLES} == {t: stored[t] for t in SETTLED_TABLES}


@pytest.mark.once
def test_demo_every_layer_produced_data(tmp_path: Path) -> None:
    demo = Demo(tmp_path, *FAST, "--duration", "600")
    try:
        demo.wait_for(r"\(Ctrl-C to stop\)", 150)
        text = demo.text()
        shown = findings_shown(demo, text)
        pids = demo.descendants()
        assert pids, "the sidecar runs as a child process"
        with httpx.Client(base_url=demo.base, timeout=10, trust_env=False) as http:
            m = settled_scrape(http)
            assert_layout_layer(http)
            later = explain_shown(demo, text, http)
        assert_prometheus_layer(m, shown)
        assert_rows_acknowledged(m)
        assert_client_layer(m)
        assert_decision_log(demo, text, shown)
        demo.proc.send_signal(signal.SIGINT)
        assert demo.finish() == 130, demo.text()
    finally:
        demo.kill()
    assert_gone(pids)
    assert_store_rows(stored_rows(demo.data / "chdb"), shown, text)
    assert len(later) == 2, later  # one request's story and --worst, as printed
    for command in later:
        done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stderr)
        assert "request" in done.stdout


@pytest.mark.once
def test_ctrl_c_mid_run_stops_everything(tmp_path: Path) -> None:
    demo = Demo(tmp_path, "--step-ms", "10", "--requests", "200")
    try:
        demo.wait_for(r"answered \d+/200", 120)  # the live view's first line
        time.sleep(2.0)  # requests in flight, the pool filling
        pids = demo.descendants()
        demo.proc.send_signal(signal.SIGINT)
        assert demo.finish() == 130, demo.text()
        assert "stopped (Ctrl-C)" in demo.text()
    finally:
        demo.kill()
    assert_gone(pids)


def test_a_demo_stopped_mid_run_leaves_no_process(tmp_path: Path) -> None:
    """What a failing test's ``finally`` does: the demo is stopped while it drives its
    workload, and nothing it started is left running."""
    demo = Demo(tmp_path, *FAST, "--duration", "600")
    try:
        demo.wait_for(r"answered \d+/", 150)  # the live view: workload under way
        pids = demo.descendants()
        assert pids, "the sidecar runs as a child process"
    finally:
        demo.kill()
    assert_gone(pids)
