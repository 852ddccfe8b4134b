"""deploy/kubernetes rendered and validated offline.

``kubectl kustomize`` renders an overlay; ``kubernetes-validate`` checks built-in kinds
against the Kubernetes OpenAPI schema (strict: an unknown field is an error, as
``kubectl apply --validate=strict`` makes it); the Prometheus Operator's kinds are checked
against the CRDs vendored in tests/stack/crds (see its README), made strict the same way.
checkov runs from its own venv (tools/checkov, installed from its pinned requirements by
``scripts/install.sh --dev``).
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests.stack.composespec import ROOT
from tests.stack.tools import require

KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
CRDS = Path(__file__).resolve().parent / "crds"
CHECKOV = ROOT / "tools" / "checkov"
KUBE_VERSIONS = ("1.29", "1.37")
"""The oldest Kubernetes with native sidecars on by default, and the newest schema
kubernetes-validate ships."""

Obj = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise AssertionError("kubectl is not installed (it comes with this kind of machine)")
    return path


def render(kustomization_dir: Path) -> list[Obj]:
    """Every object ``kubectl kustomize DIR`` prints; fails with kubectl's error."""
    done = subprocess.run([kubectl(), "kustomize", str(kustomization_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {kustomization_dir}: {done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind
            and (name is None or o["metadata"]["name"] == name)]


def validate_builtin(obj: Obj, version: str) -> list[str]:
    """Errors of one built-in object against the Kubernetes schema of ``version``."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{obj['kind']}/{obj['metadata']['name']} ({version}): "
                f"{'/'.join(map(str, e.path))}: {e.message}"]
    return []


@cache
def crd_schemas() -> dict[tuple[str, str], Obj]:
    """(apiVersion, kind) -> strict JSON schema, from every vendored CRD's served versions."""
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for ver in crd["spec"]["versions"]:
            if ver.get("served"):
                out[(f"{group}/{ver['name']}", kind)] = _strict(ver["schema"]["openAPIV3Schema"])
    return out


def _strict(schema: Any) -> Any:
    """Objects with declared properties refuse undeclared ones (unless the CRD says to
    keep unknown fields), as the API server's strict field validation does."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def validate_custom(obj: Obj) -> list[str]:
    """Errors of one custom resource against its CRD; its metadata is checked as
    Kubernetes checks any ObjectMeta."""
    key = (obj["apiVersion"], obj["kind"])
    schema = crd_schemas().get(key)
    if schema is None:
        return [f"no vendored CRD for {key}"]
    name = f"{obj['kind']}/{obj['metadata']['name']}"
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{name}: {'/'.join(map(str, e.path))}: {e.message}"
              for e in validator.iter_errors(obj)]
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
    return errors + validate_builtin(meta, KUBE_VERSIONS[-1])


def validate(obj: Obj) -> list[str]:
    """Every schema error of one rendered object, built-in or custom."""
    if obj["apiVersion"].split("/")[0].endswith("coreos.com"):
        return validate_custom(obj)
    return [e for v in KUBE_VERSIONS for e in validate_builtin(obj, v)]


def checkov() -> str:
    """The checkov executable of tools/checkov/.venv (``scripts/install.sh --dev``)."""
    return str(require(CHECKOV / ".venv" / "bin" / "checkov", "checkov"))


def scan(directory: Path) -> Obj:
    """checkov's Kubernetes results (JSON) for every manifest under ``directory``."""
    done = subprocess.run([checkov(), "--directory", str(directory), "--framework",
                           "kubernetes", "--output", "json", "--skip-download"],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(done.stdout)
    assert isinstance(report, dict) and report["check_type"] == "kubernetes", done.stderr
    return dict(report)
