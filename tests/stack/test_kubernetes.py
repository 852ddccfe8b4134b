"""deploy/kubernetes checked without a cluster.

Every overlay renders with ``kubectl kustomize``; every object validates against the
Kubernetes schema (kubernetes-validate, strict) or the vendored Prometheus Operator CRDs;
the PrometheusRule is the rule file (promtool checks it and runs alerts/tests on it) and
the dashboard ConfigMaps are the committed dashboards; the pod wires the probe into vLLM's
unmodified image over an ipc socket; checkov finds nothing that the manifests do not
justify; the images build from this repository, and the probe installer really installs.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from alerts.config import Config as AlertsConfig
from alerts.rules import build
from kvscope import __version__
from kvscope.sinks.options import DeliveryOptions
from tests.stack.dockerfiles import check_copies, missing_local_dependencies
from tests.stack.kubespec import (
    KUBE,
    OVERLAYS,
    Obj,
    find,
    render,
    scan,
    validate,
)
from tests.stack.promstack import REPO, binary

IMAGES = {"kvscope/sidecar": "deploy/kvscope/Dockerfile",
          "kvscope/probe-installer": "deploy/probe-installer/Dockerfile"}
ALERT_TESTS = sorted((REPO / "alerts" / "tests").glob("*.yml"))
SECRET = re.compile(r"(TOKEN|DSN|PASSWORD|SECRET|LOKI_URL)$", re.IGNORECASE)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    assert {p.name for p in OVERLAYS} >= {"single-gpu", "node-8gpu"}
    return {p.name: render(p) for p in OVERLAYS}


def pod(objs: list[Obj]) -> dict[str, Any]:
    (dep,) = find(objs, "Deployment", "vllm")
    return dict(dep["spec"]["template"]["spec"])


def containers(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def flag(c: dict[str, Any], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith(f"{name}=")]
    return value


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def mounts(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the mount (its volume name, readOnly)."""
    return {m["mountPath"]: m for m in c.get("volumeMounts", [])}


def test_every_overlay_renders_the_same_objects(rendered: dict[str, list[Obj]]) -> None:
    want = {("Deployment", "vllm"), ("Service", "vllm"), ("Service", "kvscope"),
            ("ServiceMonitor", "kvscope"), ("PrometheusRule", "kvscope"),
            ("NetworkPolicy", "kvscope")}
    want |= {("ConfigMap", f"grafana-dashboard-{f.stem}")
             for f in (REPO / "dashboards" / "json").glob("*.json")}
    for name, objs in rendered.items():
        assert {(o["kind"], o["metadata"]["name"]) for o in objs} == want, name
        assert {o["metadata"]["namespace"] for o in objs} == {"vllm"}, name


def test_every_object_validates_against_its_schema(rendered: dict[str, list[Obj]]) -> None:
    errors = [e for objs in rendered.values() for o in objs for e in validate(o)]
    assert errors == []
    mistakes = {
        "sidecar field": lambda o: pod(o)["initContainers"][1].update(restartPolicyy="Always"),
        "quantity": lambda o: pod(o)["containers"][0]["resources"]["requests"].update(cpu={}),
        "monitor field": lambda o: find(o, "ServiceMonitor")[0]["spec"]["endpoints"][0].update(
            intervall="15s"),
        "rule field": lambda o: find(o, "PrometheusRule")[0]["spec"]["groups"][0]["rules"][0]
        .update(exprr="up"),
        "custom metadata": lambda o: find(o, "PrometheusRule")[0]["metadata"].update(lables={}),
    }
    for what, mistake in mistakes.items():
        objs = copy.deepcopy(rendered["single-gpu"])
        mistake(objs)
        assert [e for o in objs for e in validate(o)], f"the validators missed a {what} mistake"


def test_prometheus_rule_is_the_rule_file_and_passes_promtool(
        rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    for objs in rendered.values():
        (rule,) = find(objs, "PrometheusRule")
        assert rule["spec"] == build() == yaml.safe_load(
            (REPO / "alerts" / "kvscope.rules.yml").read_text())
    done = subprocess.run([sys.executable, "-m", "alerts.generate", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    groups = tmp_path / "prometheusrule-groups.yml"
    groups.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    checked = subprocess.run([binary("promtool"), "check", "rules", str(groups)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stderr
    tests = []
    for path in ALERT_TESTS:
        case = yaml.safe_load(path.read_text())
        assert case["rule_files"] == ["../kvscope.rules.yml"], path
        case["rule_files"] = [str(groups)]
        tests.append(tmp_path / path.name)
        tests[-1].write_text(yaml.safe_dump(case, sort_keys=False))
    ran = subprocess.run([binary("promtool"), "test", "rules", *map(str, tests)],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.count("SUCCESS") == len(ALERT_TESTS) > 0, ran.stdout


def test_dashboard_configmaps_are_the_committed_dashboards(
        rendered: dict[str, list[Obj]]) -> None:
    committed = {f.name: f.read_text() for f in (REPO / "dashboards" / "json").glob("*.json")}
    for objs in rendered.values():
        maps = find(objs, "ConfigMap")
        assert {k: v for m in maps for k, v in m["data"].items()} == committed
        for m in maps:
            assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
            assert m["metadata"]["annotations"]["grafana_folder"] == "kvscope"
            assert len(yaml.safe_dump(m)) < 256 << 10, "fits kubectl apply's annotation"


def test_probe_reaches_vllms_unmodified_image_over_an_ipc_socket(
        rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        spec = pod(objs)
        c = containers(spec)
        assert [i["name"] for i in spec["initContainers"]] == ["kvscope-probe-install", "kvscope"]
        install, side, vllm = c["kvscope-probe-install"], c["kvscope"], c["vllm"]
        assert "restartPolicy" not in install and side["restartPolicy"] == "Always"
        assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", vllm["image"])
        assert vllm["command"] == ["vllm", "serve"]
        assert "--middleware=kvscope_probe.middleware.KVScopeMiddleware" in vllm["args"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (target,) = install["args"]
        lib = mounts(install)[target]["name"]
        assert env(vllm)["PYTHONPATH"] == target and "emptyDir" in volumes[lib]
        assert mounts(vllm)[target] == {"mountPath": target, "name": lib, "readOnly": True}
        endpoint = flag(side, "--endpoint")
        assert endpoint.startswith("ipc://") and env(vllm)["KVSCOPE_PROBE_ENDPOINT"] == endpoint
        sock_dir = str(Path(endpoint.removeprefix("ipc://")).parent)
        ipc = mounts(side)[sock_dir]["name"]
        assert mounts(vllm)[sock_dir]["name"] == ipc and "emptyDir" in volumes[ipc]
        assert "tcp://" not in yaml.safe_dump(spec), "no tcp endpoint inside the pod"
        port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "http")
        assert flag(side, "--vllm-url") == f"http://127.0.0.1:{port}"


def test_health_probes_follow_the_contract(rendered: dict[str, list[Obj]]) -> None:
    """/healthz (the sidecar itself works) for startup and liveness, on the port the
    sidecar serves, without a token. No readiness probe on the sidecar: the pod's
    readiness is vLLM's own (/readyz needs a connected probe, and the probe connects on the
    first request, which a pod out of its Service never gets)."""
    from kvscope.sidecar.http.app import OPEN_PATHS

    for objs in rendered.values():
        c = containers(pod(objs))
        side, vllm = c["kvscope"], c["vllm"]
        (port,) = side["ports"]
        assert port["containerPort"] == int(flag(side, "--port"))
        for probe in ("startupProbe", "livenessProbe"):
            assert side[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}, probe
        assert "readinessProbe" not in side
        assert "/healthz" in OPEN_PATHS, "kubelet's probes carry no token"
        assert {vllm[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe",
                                                     "readinessProbe")} == {"/health"}


def test_secrets_spool_and_security_context(rendered: dict[str, list[Obj]]) -> None:
    spool_limit = 2 * DeliveryOptions().spool_max_bytes  # ClickHouse and Loki sinks
    for objs in rendered.values():
        assert not find(objs, "Secret"), "secrets are created out of band, never committed"
        spec = pod(objs)
        assert spec["automountServiceAccountToken"] is False
        side = containers(spec)["kvscope"]
        refs = {k: v["secretKeyRef"] for k, v in env(side).items() if SECRET.search(k)}
        assert refs["KVSCOPE_TOKEN"] == {"name": "kvscope", "key": "token"}
        assert refs["KVSCOPE_CLICKHOUSE_DSN"] == {"name": "kvscope", "key": "clickhouse-dsn"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        key_dir, key_file = flag(side, "--hash-key-file").rsplit("/", 1)
        key_volume = volumes[mounts(side)[key_dir]["name"]]["secret"]
        assert key_volume["secretName"] == "kvscope" and "optional" not in key_volume
        assert key_volume["items"] == [{"key": "hash-key", "path": key_file}]
        # 0444, not 0440 with the pod's fsGroup: a Deployment the component is added to may
        # have no fsGroup (the file is then root:root) or another one.
        assert key_volume["defaultMode"] == 0o444
        assert not any(m["name"] == mounts(side)[key_dir]["name"]
                       for c in containers(spec).values() if c is not side
                       for m in c.get("volumeMounts", ())), "the hash key is the sidecar's alone"
        spool = volumes[mounts(side)[flag(side, "--data-dir")]["name"]]["emptyDir"]
        assert _bytes(spool["sizeLimit"]) >= spool_limit
        uids = set()
        for name, c in containers(spec).items():
            for key, value in env(c).items():
                assert not SECRET.search(key) or "secretKeyRef" in value, (name, key)
            sc = {**spec["securityContext"], **c["securityContext"]}
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), name
            uids.add(sc["runAsUser"])
        assert len(uids) == 1, "vLLM must be allowed to connect to the sidecar's socket"
    text = "\n".join(p.read_text() for p in KUBE.rglob("*.yaml") if "generated" not in p.parts)
    assert not re.search(r"(password|token)\s*[:=]\s*['\"]?[A-Za-z0-9]{8,}", text, re.I)


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)", quantity).groups()  # type: ignore[union-attr]
    return int(number) << (10 * ("KMGT".index(unit[0]) + 1))


def test_prometheus_scrapes_every_sidecar_through_the_policy(
        rendered: dict[str, list[Obj]]) -> None:
    for objs in rendered.values():
        (dep,) = find(objs, "Deployment", "vllm")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        side = containers(pod(objs))["kvscope"]
        (svc,) = find(objs, "Service", "kvscope")
        assert svc["spec"]["selector"].items() <= labels.items()
        (port,) = svc["spec"]["ports"]
        assert port["targetPort"] == side["ports"][0]["name"]
        assert AlertsConfig().selector == f'job="{svc["metadata"]["name"]}"', "the job label"
        (mon,) = find(objs, "ServiceMonitor")
        assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        (endpoint,) = mon["spec"]["endpoints"]
        assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
        assert endpoint["authorization"]["credentials"] == env(side)["KVSCOPE_TOKEN"][
            "secretKeyRef"]
        (rule,) = find(objs, "PrometheusRule")
        assert mon["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"]
        (pol,) = find(objs, "NetworkPolicy")
        assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert set(pol["spec"]["policyTypes"]) == {"Ingress", "Egress"}
        by_port = {p["port"]: r for r in pol["spec"]["ingress"] for p in r["ports"]}
        scrape = by_port[side["ports"][0]["containerPort"]]["from"]
        assert any("namespaceSelector" in f for f in scrape), "Prometheus's namespace"
        assert 8000 in by_port
        egress = {(p["port"], p["protocol"]) for r in pol["spec"]["egress"] for p in r["ports"]}
        assert {(53, "UDP"), (53, "TCP"), (8123, "TCP"), (443, "TCP")} <= egress


def test_node_8gpu_runs_one_server_per_gpu(rendered: dict[str, list[Obj]]) -> None:
    for name, objs in rendered.items():
        (dep,) = find(objs, "Deployment", "vllm")
        spec = dep["spec"]["template"]["spec"]
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu", 0)
                for c in containers(spec).values()]
        assert gpus.count(1) == 1 and sum(gpus) == 1, (name, gpus)
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "no GPU to surge into"
        assert dep["spec"]["replicas"] == {"single-gpu": 1, "node-8gpu": 8}[name]
    assert pod(rendered["node-8gpu"])["nodeSelector"] == {"nvidia.com/gpu.count": "8"}


def test_component_adds_kvscope_to_an_existing_deployment(tmp_path: Path) -> None:
    """What the README tells an operator to do: label the Deployment and add the
    component; their own containers, env and volumes stay; unlabelled ones are untouched."""
    theirs = yaml.safe_load("""
apiVersion: apps/v1
kind: Deployment
metadata: {name: llama, labels: {kvscope/inject: "true"}}
spec:
  selector: {matchLabels: {app: llama}}
  template:
    metadata: {labels: {app: llama}}
    spec:
      containers:
        - name: vllm
          image: vllm/vllm-openai:v0.32.0
          args: [meta-llama/Llama-3.1-8B-Instruct]
          env: [{name: VLLM_LOGGING_LEVEL, value: INFO}]
          volumeMounts: [{name: cache, mountPath: /root/.cache}]
      volumes: [{name: cache, emptyDir: {}}]
""")
    other = copy.deepcopy(theirs)
    other["metadata"] = {"name": "embedder"}
    (tmp_path / "deploy.yaml").write_text(yaml.safe_dump_all([theirs, other]))
    component = KUBE / "components" / "kvscope"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["deploy.yaml"], "components": [os.path.relpath(component, tmp_path)]}))
    objs = render(tmp_path)
    (llama,) = find(objs, "Deployment", "llama")
    spec = llama["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    assert [c["name"] for c in spec["initContainers"]] == ["kvscope-probe-install", "kvscope"]
    vllm = spec["containers"][0]
    assert env(vllm)["VLLM_LOGGING_LEVEL"] == "INFO" and "PYTHONPATH" in env(vllm)
    assert "/root/.cache" in mounts(vllm) and "/run/kvscope" in mounts(vllm)
    assert {"cache", "kvscope-probe", "kvscope-ipc"} <= {v["name"] for v in spec["volumes"]}
    assert llama["spec"]["template"]["metadata"]["labels"]["kvscope/sidecar"] == "true"
    assert find(objs, "Deployment", "embedder")[0] == other


def test_images_build_from_this_repository(rendered: dict[str, list[Obj]]) -> None:
    used = {c["image"] for objs in rendered.values()
            for c in containers(pod(objs)).values() if c["image"].startswith("kvscope/")}
    assert used == {f"{name}:{__version__}" for name in IMAGES}
    for dockerfile in sorted(REPO.glob("deploy/*/Dockerfile")):
        check_copies(REPO, dockerfile)
        assert missing_local_dependencies(dockerfile) == [], dockerfile
        for line in dockerfile.read_text().splitlines():
            if line.startswith("FROM "):
                assert re.search(r":[\w.-]*\d", line) and ":latest" not in line, line
    installer = (REPO / IMAGES["kvscope/probe-installer"]).read_text()
    assert "USER 10001:10001" in installer
    assert 'ENTRYPOINT ["/bin/sh", "/usr/local/bin/kvscope-probe-install"]' in installer
    cmd = re.search(r"^CMD (.*)$", installer, re.MULTILINE)
    side = containers(pod(rendered["single-gpu"]))
    assert cmd and yaml.safe_load(cmd.group(1)) == side["kvscope-probe-install"]["args"]
    assert "--uid 10001 " in (REPO / IMAGES["kvscope/sidecar"]).read_text()


def test_probe_installer_installs_the_plugin_vllm_finds(tmp_path: Path) -> None:
    """install.sh, as the init container runs it (offline, from the image's wheel), twice
    into the same volume; then the plugin is found from that path and the standard
    library alone, as vLLM's Python will find it."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "exporter" / "kvscope_probe", src,
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    wheels, target = tmp_path / "wheels", tmp_path / "opt" / "kvscope-probe"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(wheels), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), "any vLLM's Python must load it"
    envs = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/nonexistent",
            "TMPDIR": str(tmp_path), "KVSCOPE_PROBE_WHEELS": str(wheels)}
    script = REPO / "deploy" / "probe-installer" / "install.sh"
    for _ in range(2):
        done = subprocess.run(["/bin/sh", str(script), str(target)], env=envs,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == f"kvscope-probe 0.1.0 installed in {target}"
    assert not list(target.rglob("*.pyc")), "vLLM's Python may be another version"
    found = subprocess.run(
        [sys.executable, "-S", "-c",
         "import importlib.metadata as m; import kvscope_probe.plugin as p; "
         "print([e.value for e in m.entry_points(group='vllm.general_plugins')], p.__file__)"],
        env={"PYTHONPATH": str(target)}, capture_output=True, text=True, timeout=60)
    assert found.stdout.split() == ["['kvscope_probe.plugin:register']",
                                    str(target / "kvscope_probe" / "plugin.py")], found.stderr
    broken = subprocess.run(["/bin/sh", str(script), str(tmp_path / "t2")],
                            env={**envs, "KVSCOPE_PROBE_WHEELS": str(tmp_path / "none")},
                            capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0, "a missing wheel must fail the init container"


def test_checkov_finds_nothing_unjustified(rendered: dict[str, list[Obj]],
                                          tmp_path: Path) -> None:
    for name, objs in rendered.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(objs))
    report = scan(tmp_path)
    results = report["results"]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in results["failed_checks"]]
    assert failed == [], failed
    assert report["summary"]["passed"] > 50 and report["summary"]["parsing_errors"] == 0
    skips = {}
    for path in KUBE.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            for key, value in ((doc or {}).get("metadata", {}).get("annotations") or {}).items():
                if key.startswith("checkov.io/skip"):
                    check, reason = value.split("=")
                    assert len(reason.split()) >= 12, f"{path}: {check} needs its reason"
                    skips[check] = reason
    skipped = {c["check_id"]: c["check_result"]["suppress_comment"]
               for c in results["skipped_checks"]}
    assert skipped == skips, "each skip is used, and nothing else is skipped"
