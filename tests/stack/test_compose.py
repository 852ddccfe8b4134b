"""docker-compose.yml and deploy/ checked without a Docker engine.

The Compose specification's schema, every mounted file and build input, promtool and amtool
on the configs (container paths mapped back through the mounts), Grafana provisioning
against the committed dashboards, loopback-only ports, pinned images, healthchecks, named
volumes, and no secret with a default.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from alerts.config import Config as AlertsConfig
from dashboards.config import CLICKHOUSE_PLUGIN_VERSION, CLICKHOUSE_TYPE
from tests.stack.composespec import ROOT, bind_mounts, compose, host_path, schema
from tests.stack.dockerfiles import check_copies
from tests.stack.promstack import binary

DEPLOY = ROOT / "deploy"
SECRET = re.compile(r"PASSWORD|TOKEN|SECRET|API_KEY|DSN", re.IGNORECASE)
REQUIRED = re.compile(r"\$\{(\w+):\?[^}]*\}")
DEFAULTED = re.compile(r"\$\{(\w+):?-([^}]*)\}")


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return compose()


@pytest.fixture(scope="module")
def services(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(spec["services"])


def test_compose_file_validates_against_the_compose_spec(spec: dict[str, Any]) -> None:
    s = schema()
    validator = jsonschema.validators.validator_for(s)(s)
    errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(spec)]
    assert not errors, errors
    broken = copy.deepcopy(spec)
    broken["services"]["grafana"]["healthcheck"]["intervall"] = "10s"
    broken["services"]["loki"]["ports"] = [{"published": "3100", "bogus": True}]
    assert len(list(validator.iter_errors(broken))) >= 2, "the validator must catch errors"


def test_profiles_pair_each_engine_with_a_sidecar(services: dict[str, dict[str, Any]]) -> None:
    by_profile: dict[str, set[str]] = {}
    for name, svc in services.items():
        for prof in svc.get("profiles", []):
            by_profile.setdefault(prof, set()).add(name)
    assert by_profile == {"gpu": {"vllm-gpu", "kvscope-gpu"},
                          "cpu": {"vllm-cpu", "loadgen", "kvscope"}}
    assert services["vllm-gpu"]["image"].startswith("kvscope/vllm-openai:v")
    assert "nvidia" in json.dumps(services["vllm-gpu"]["deploy"])
    assert "deploy" not in services["vllm-cpu"], "the cpu profile must not need a GPU"
    middleware = "kvscope_probe.middleware.KVScopeMiddleware"
    assert f"--middleware={middleware}" in services["vllm-gpu"]["command"]
    assert middleware in (DEPLOY / "vllm-cpu" / "serve.py").read_text()
    for name in ("vllm-gpu", "vllm-cpu"):
        assert "vllm" in services[name]["networks"]["default"]["aliases"]
        assert services[name]["environment"]["KVSCOPE_PROBE_ENDPOINT"] == "tcp://kvscope:5557"
    assert "kvscope" in services["kvscope-gpu"]["networks"]["default"]["aliases"]
    gpu_from = (DEPLOY / "vllm-gpu" / "Dockerfile").read_text()
    assert re.search(r"^FROM vllm/vllm-openai:v\d+\.\d+\.\d+$", gpu_from, re.MULTILINE)
    cpu_from = (DEPLOY / "vllm-cpu" / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11[\w.-]*-slim", cpu_from, re.MULTILINE)
    assert '"/opt/kvscope[vllm]"' in cpu_from


def test_every_mount_and_build_input_exists(spec: dict[str, Any],
                                            services: dict[str, dict[str, Any]]) -> None:
    declared = set(spec.get("volumes", {}))
    used: set[str] = set()
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith((".", "/")):
                assert (ROOT / src).exists(), f"{name} mounts {src}, which does not exist"
            else:
                used.add(src)
        build = svc.get("build")
        if build:
            context = ROOT / build["context"]
            dockerfile = context / build["dockerfile"]
            assert dockerfile.is_file(), (name, dockerfile)
            check_copies(context, dockerfile)
    assert used == declared, f"named volumes used {sorted(used)} vs declared {sorted(declared)}"


def test_prometheus_config_passes_promtool(services: dict[str, dict[str, Any]],
                                           tmp_path: Path) -> None:
    prom = services["prometheus"]
    cfg_path = host_path(prom, "/etc/prometheus/prometheus.yml")
    assert cfg_path and "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    cfg = yaml.safe_load(cfg_path.read_text())
    rules = []
    for f in cfg["rule_files"]:
        src = host_path(prom, f)
        assert src is not None and src.is_file(), f"rule file {f} is not mounted"
        rules.append(str(src))
    cfg["rule_files"] = rules
    run_sh = host_path(prom, prom["entrypoint"][-1])
    assert run_sh is not None and run_sh.is_file()
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "kvscope")
    assert f'job="{job["job_name"]}"' == AlertsConfig().selector
    token_file = job["authorization"]["credentials_file"]
    assert f"> {token_file}" in run_sh.read_text(), "run.sh must write the token file"
    (tmp_path / "token").write_text("test-token")
    job["authorization"]["credentials_file"] = str(tmp_path / "token")
    assert job["static_configs"][0]["targets"] == ["kvscope:9477"]
    assert "--port=9477" in services["kvscope"]["command"]
    out = tmp_path / "prometheus.yml"
    out.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([binary("promtool"), "check", "config", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"\n{done.stdout.strip()}")


def test_alertmanager_config_passes_amtool(services: dict[str, dict[str, Any]]) -> None:
    am = services["alertmanager"]
    path = host_path(am, "/etc/alertmanager/alertmanager.yml")
    assert path is not None
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in am["command"]
    assert "--cluster.listen-address=" in am["command"], "no gossip port for one instance"
    done = subprocess.run([binary("amtool"), "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    prom_cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = prom_cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert targets == ["alertmanager:9093"]


def test_grafana_provisions_the_committed_dashboards_and_their_datasources(
        services: dict[str, dict[str, Any]]) -> None:
    graf = services["grafana"]
    prov = host_path(graf, "/etc/grafana/provisioning")
    assert prov is not None and prov.is_dir()
    providers = yaml.safe_load((prov / "dashboards" / "kvscope.yml").read_text())["providers"]
    for p in providers:
        src = host_path(graf, p["options"]["path"])
        assert src is not None and src.is_dir(), p
        uids = {json.loads(f.read_text())["uid"] for f in src.glob("*.json")}
        assert uids == set(vars(AlertsConfig().dashboards).values()), uids
    sources = yaml.safe_load((prov / "datasources" / "kvscope.yml").read_text())["datasources"]
    types = {d["type"] for d in sources}
    wanted = set()
    for f in (ROOT / "dashboards" / "json").glob("*.json"):
        for v in json.loads(f.read_text())["templating"]["list"]:
            if v["type"] == "datasource":
                wanted.add(v["query"])
    assert wanted <= types, f"dashboards need {wanted - types}"
    hosts = {"prometheus": "prometheus:9090", "loki": "loki:3100",
             "alertmanager": "alertmanager:9093"}
    for d in sources:
        if d["type"] in hosts:
            assert d["url"] == f"http://{hosts[d['type']]}", d
    ch = next(d for d in sources if d["type"] == "grafana-clickhouse-datasource")
    assert ch["jsonData"]["host"] == "clickhouse" and ch["jsonData"]["port"] == 8123
    var = ch["secureJsonData"]["password"].lstrip("$")
    assert var in graf["environment"], f"Grafana expands ${var} from its environment"
    plugin = f"{CLICKHOUSE_TYPE} {CLICKHOUSE_PLUGIN_VERSION}"
    assert graf["environment"]["GF_INSTALL_PLUGINS"] == plugin, "the version targets are for"
    user = ET.parse(host_path(services["clickhouse"],
                              "/etc/clickhouse-server/users.d/grafana.xml")).getroot()
    grafana = user.find("users/grafana")
    assert grafana is not None and ch["jsonData"]["username"] == "grafana"
    pw = grafana.find("password")
    assert pw is not None and pw.get("from_env") in services["clickhouse"]["environment"]
    assert user.find("profiles/grafana_readonly/readonly").text == "1"  # type: ignore[union-attr]


def test_the_decision_log_reaches_alloy(services: dict[str, dict[str, Any]]) -> None:
    """The sidecar writes the file Alloy's config tails, into a volume Alloy mounts."""
    log = next(a.split("=", 1)[1] for a in services["kvscope"]["command"]
               if a.startswith("--decision-log="))
    alloy = services["alloy"]
    config = host_path(alloy, alloy["command"][-1])
    assert config == (ROOT / "loki" / "config.alloy").resolve()
    pattern = re.search(r'__path__\s*=\s*"([^"]+)"', config.read_text())
    assert pattern and fnmatch.fnmatch(log, pattern.group(1)), (log, pattern)
    vol = {v.split(":")[1]: v.split(":")[0] for v in services["kvscope"]["volumes"]}
    alloy_vol = {v.split(":")[1]: v.split(":")[0] for v in alloy["volumes"]}
    log_dir = str(Path(log).parent)
    assert vol[log_dir] == alloy_vol[log_dir], "sidecar and Alloy must share the log volume"
    assert alloy["environment"]["LOKI_PUSH_URL"] == "http://loki:3100/loki/api/v1/push"
    loki = yaml.safe_load((DEPLOY / "loki" / "loki.yml").read_text())
    assert loki["server"]["http_listen_port"] == 3100 and loki["auth_enabled"] is False


def test_published_ports_bind_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    published = []
    for name, svc in services.items():
        assert svc.get("network_mode") != "host", name
        for port in svc.get("ports", []):
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", (name, port)
            else:
                assert str(port).startswith("127.0.0.1:"), (name, port)
            published.append(name)
    assert {"grafana", "prometheus", "kvscope"} <= set(published)


def test_images_are_pinned_and_every_service_is_healthchecked(
        services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        image = svc["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        assert tag and tag != "latest" and re.search(r"\d", tag), (name, image)
        hc = svc.get("healthcheck")
        assert hc and not hc.get("disable") and hc.get("test"), f"{name} has no healthcheck"
    for dockerfile in DEPLOY.glob("*/Dockerfile"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("FROM "):
                assert re.search(r":[\w.-]*\d", line) and ":latest" not in line, line


def test_no_secret_has_a_default(services: dict[str, dict[str, Any]]) -> None:
    text = "\n".join(line for line in (ROOT / "docker-compose.yml").read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            if not SECRET.search(key):
                continue
            value = str(value)
            assert REQUIRED.search(value) or value in ("${HF_TOKEN:-}",), (name, key, value)
            for var, default in DEFAULTED.findall(value):
                assert not default, f"{name}: {key} gives {var} a default"
    example = (DEPLOY / "env.example").read_text()
    for var in set(REQUIRED.findall(text)):
        assert re.search(rf"^{var}=$", example, re.MULTILINE), f"{var} not in env.example"
    for path in [*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.xml")]:
        body = path.read_text()
        assert not re.search(r"(password|token|secret)\s*[:=]\s*['\"]?[A-Za-z0-9]{6,}",
                             body, re.IGNORECASE), f"{path} holds a literal secret"


def test_sidecar_and_probe_agree_on_the_endpoint(services: dict[str, dict[str, Any]]) -> None:
    cmd = services["kvscope"]["command"]
    assert "--endpoint=tcp://0.0.0.0:5557" in cmd and "--host=0.0.0.0" in cmd
    assert "KVSCOPE_TOKEN" in services["kvscope"]["environment"], "a non-loopback bind"
    assert services["kvscope"]["environment"]["KVSCOPE_CLICKHOUSE_DSN"].endswith(
        "@clickhouse:8123/kvscope")
    assert bind_mounts(services["kvscope"]) == {}, "the sidecar needs no host files"


def test_cpu_server_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/vllm-cpu/serve.py runs the engine tests' command line on 0.0.0.0 with the
    middleware (model generation and exec captured, not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve", DEPLOY / "vllm-cpu" / "serve.py")
    assert spec is not None and spec.loader is not None
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    calls: list[list[str]] = []
    monkeypatch.setattr(serve, "make_tiny_model", lambda path: path)
    monkeypatch.setattr(serve.os, "execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setattr(serve.os, "environ", {"VLLM_NUM_BLOCKS": "64"})
    serve.main()
    (argv,) = calls
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]

    def opt(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert opt("--host") == "0.0.0.0" and opt("--port") == "8000"
    assert opt("--num-gpu-blocks-override") == "64"
    assert opt("--middleware") == "kvscope_probe.middleware.KVScopeMiddleware"


def test_lokis_request_id_link_opens_the_explain_page(services: dict[str, dict[str, Any]]) -> None:
    """The derived field finds the request ID in a real decision-log line and links to the
    sidecar's /ui/requests page at the URL Grafana's environment names."""
    import re

    from kvscope.decisions.log import decision_line
    from kvscope.rows import SchedulerDecision

    graf = services["grafana"]
    prov = host_path(graf, "/etc/grafana/provisioning")
    assert prov is not None
    sources = yaml.safe_load((prov / "datasources" / "kvscope.yml").read_text())["datasources"]
    (field,) = next(d for d in sources if d["type"] == "loki")["jsonData"]["derivedFields"]
    line = decision_line(SchedulerDecision(
        ts=1.0, model="m", engine="0", decision="preempt", request_id="cmpl-7a/x", reason="kv_full",
        blocks_needed=1, free_blocks=0, max_contiguous_free=0, tokens=5, policy="fcfs",
        msg="Preempting request cmpl-7a/x"))
    assert re.search(field["matcherRegex"], line).group(1) == "cmpl-7a/x"
    assert field["url"] == "${KVSCOPE_SIDECAR_URL}/ui/requests/$${__value.raw:percentencode}"
    assert graf["environment"]["KVSCOPE_SIDECAR_URL"].endswith("http://localhost:9477}")
