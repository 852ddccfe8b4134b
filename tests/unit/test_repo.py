"""The README's promises that a script can check."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import socket
import time
from pathlib import Path

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvscope_probe import wire

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", text)[:2]


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    demo, tests = readme_commands()
    assert demo.endswith("kvscope demo")
    assert "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command() -> None:
    _, tests = readme_commands()
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines


def test_every_python_dependency_is_pinned_within_its_range() -> None:
    """scripts/install.sh installs with ``-c constraints.txt``: each dependency
    pyproject.toml names (the probe's, the sidecar's, the vllm and dev extras') has a pin
    there that its range admits, so a fresh machine installs what the tests ran with. A
    dependency added without regenerating the lock (scripts/lock-constraints.py) fails."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "-c constraints.txt" in install
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    probe = tomllib.loads((ROOT / "exporter" / "kvscope_probe" / "pyproject.toml")
                          .read_text())["project"]
    named = [*project["dependencies"], *probe.get("dependencies", []),
             *(d for extra in project["optional-dependencies"].values() for d in extra)]
    for text in named:
        req = Requirement(text)
        if canonicalize_name(req.name) in ("kvscope", "kvscope-probe"):
            continue
        version = pins.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(version, prereleases=True), (req.name, version)


def readme_metric_rows() -> list[tuple[list[tuple[str, str | None]], set[str] | None]]:
    """The README's Metrics table: per row, the names of its first cell (each with the
    labels written after it, or None) and the row's labels (None: ``{...}``, any).

    A name starting with ``_`` abbreviates one that shares a prefix with the name before
    it (``vllm_scheduler_total_blocks``, ``_free_blocks``); it is returned as is and
    resolved against the live names."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Metrics"):text.index("## Stores and queries")]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cell = line.split("|")[1]
        names = re.findall(r"`([a-z_*]+)(?:\{([^}]*)\})?`", cell)
        row_labels: set[str] | None = set()
        for _, labels in names:
            if labels == "...":
                row_labels = None
            elif labels and row_labels is not None:
                row_labels |= set(labels.split(","))
        rows.append(([(n, labels or None) for n, labels in names], row_labels))
    return rows


def live_samples(tmp_path: Path) -> dict[str, set[str]]:
    """Sample name -> label names, from ``kvscope serve``'s own registry (the Sidecar as
    the CLI builds it), fed by vLLM's real scheduler through the probe (the twin), client
    events of the middleware's shape, one scrape of a vLLM /metrics page and a ClickHouse
    server that refuses connections."""
    from kvscope.sidecar.config import ServeConfig
    from kvscope.sidecar.server import Sidecar
    from kvscope.twin import TwinConfig, generate
    from kvscope.twin.probed import ProbedTwin
    from kvscope.twin.workload import WorkloadSpec

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    cfg = ServeConfig(endpoints=(f"ipc://{tmp_path}/p.sock",), decision_log="off",
                      clickhouse_dsn=f"http://127.0.0.1:{closed}/kvscope",
                      data_dir=str(tmp_path / "data"), vllm_url="http://127.0.0.1:1")
    side = Sidecar(cfg)
    try:
        pt = ProbedTwin(TwinConfig(num_blocks=48), seed=1, hub=side.hub)
        requests = []
        for i, r in enumerate(generate(WorkloadSpec(n_requests=40, seed=1))):
            rid = f"req-{i}"
            side.clients.on_client(wire.ClientStart(  # pairs: a prompt sent twice
                rid, time.time(), "completions", "tiny", f"team-{i // 2 % 3}", "sdk/1", "",
                f"{i // 2}", len(r.prompt_token_ids), r.max_tokens, rid))
            requests.append(dataclasses.replace(r, request_id=f"cmpl-{rid}-0-{i:08x}"))
        pt.run(requests)
        # then idle (its steps long ago), heartbeating vLLM's own count of unfinished
        from kvscope_probe.sender import unfinished

        side.hub.presence[pt.state.hello.session].last_step = time.monotonic() - 3600
        assert side.hub.accept(wire.encode(wire.Frame(
            engine=pt.engine, session=pt.state.hello.session, first_seq=pt.rec.seq,
            dropped=0, faults=0,
            records=[wire.Heartbeat(time.time(), 3600.0, unfinished(pt.scheduler))])))
        # two more live probes claiming one identity: a collision, kept apart and counted
        # the second of them on a vLLM whose Mamba relocation the fingerprint refused
        # (full attention never relocates: only the hello's ``disabled`` differs)
        from kvscope_probe import hooks

        os.environ["KVSCOPE_ENGINE"] = "twin-dup"
        try:
            for seed in (2, 3):
                if seed == 3:
                    hooks.DISABLED["relocate"] = "doctored"
                ProbedTwin(TwinConfig(num_blocks=48), seed=seed, hub=side.hub).drain()
        finally:
            del os.environ["KVSCOPE_ENGINE"]
            hooks.DISABLED.pop("relocate", None)
        for i in range(len(requests)):
            side.clients.on_client(wire.ClientEnd(f"req-{i}", time.time(), 200, 1.0, f"req-{i}"))
        assert side.scraper is not None
        page = vllm_metrics_page(pt.engine, "7")
        with httpx.Client(transport=httpx.MockTransport(
                lambda _req: httpx.Response(200, text=page))) as client:
            side.scraper.scrape_once(client)
        side.clients.flush()
        exposition = generate_latest(side.registry).decode()
    finally:
        side.sinks.close(0.5)
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(exposition):
        for smp in fam.samples:
            out.setdefault(smp.name, set()).update(smp.labels)
    return out


def vllm_metrics_page(probed: str, coarse: str) -> str:
    """vLLM 0.32's /metrics lines kvscope reads, for an engine with a probe and one without."""
    lines = []
    for engine in (probed, coarse):
        lab = f'engine="{engine}",model_name="tiny"'
        lines += [f"vllm:num_requests_running{{{lab}}} 0.0",
                  f"vllm:num_requests_waiting{{{lab}}} 0.0",
                  f"vllm:kv_cache_usage_perc{{{lab}}} 0.0",
                  f"vllm:num_preemptions_total{{{lab}}} 3.0",
                  f'vllm:cache_config_info{{block_size="32",engine="{engine}",'
                  f'num_gpu_blocks="48"}} 1.0']
    return "\n".join(lines) + "\n"


def resolve(name: str, previous: str, live: set[str]) -> list[str]:
    """The live names a README name stands for: itself, every match of a ``*`` pattern,
    or for ``_suffix`` each prefix of ``previous`` completed by it."""
    if "*" in name:
        return sorted(n for n in live if fnmatch.fnmatchcase(n, name))
    if not name.startswith("_"):
        return [name] if name in live else []
    parts = previous.split("_")
    return [c for k in range(len(parts) - 1, 0, -1)
            if (c := "_".join(parts[:k]) + name) in live]


def test_the_readme_metrics_table_is_the_live_registry(tmp_path: Path) -> None:
    """Every name the README lists is exported, with the labels it states; every sample
    the sidecar exports is listed, its labels among those its row states."""
    from kvscope.sidecar.exposition.gpu import GpuReader

    live = live_samples(tmp_path)
    gpu = GpuReader().available
    unresolved, documented = [], {}
    for names, row_labels in readme_metric_rows():
        previous = ""
        nvml = names[0][0].startswith("kvscope_gpu")
        for name, labels in names:
            found = resolve(name, previous, set(live))
            previous = previous if name.startswith("_") else name
            if nvml and not gpu:  # NVML needs a GPU; the README says these are then absent
                assert not found, found
                continue
            if not found or ("*" not in name and len(found) > 1):
                unresolved.append((name, found))
            for n in found:
                documented[n] = row_labels
                if labels and labels != "...":
                    assert set(labels.split(",")) <= live[n], (n, labels, live[n])
    assert not unresolved, f"README names that are not exactly one live name: {unresolved}"
    undocumented = sorted(set(live) - set(documented))
    assert not undocumented, f"exported but not in the README's Metrics table: {undocumented}"
    for n, row_labels in documented.items():
        if row_labels is not None:
            assert live[n] - {"server", "engine", "model"} <= row_labels, (n, live[n], row_labels)
