"""Parse LogQL with Grafana's grammar (@grafana/lezer-logql under tools/logql)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.stack.tools import require

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "logql"


def parse_errors(queries: dict[str, str]) -> dict[str, list[dict[str, object]]]:
    """Error nodes per query name (empty lists when everything parses)."""
    require(TOOL / "node_modules" / "@grafana" / "lezer-logql", "Grafana's LogQL grammar")
    payload = json.dumps([{"name": k, "query": v} for k, v in queries.items()])
    out = subprocess.run(["node", str(TOOL / "check.mjs")], input=payload, text=True,
                         capture_output=True, check=True, timeout=60)
    return {r["name"]: r["errors"] for r in json.loads(out.stdout)}
