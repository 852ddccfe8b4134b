"""Parse LogQL with Grafana's grammar (@grafana/lezer-logql under tools/logql)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "logql"


def parse_errors(queries: dict[str, str]) -> dict[str, list[dict[str, object]]]:
    """Error nodes per query name (empty lists when everything parses)."""
    if not (TOOL / "node_modules" / "@grafana" / "lezer-logql").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(TOOL)],
                       check=True, capture_output=True, timeout=300)
    payload = json.dumps([{"name": k, "query": v} for k, v in queries.items()])
    out = subprocess.run(["node", str(TOOL / "check.mjs")], input=payload, text=True,
                         capture_output=True, check=True, timeout=60)
    return {r["name"]: r["errors"] for r in json.loads(out.stdout)}
