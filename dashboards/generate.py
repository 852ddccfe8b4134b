"""Write ``dashboards/json/*.json`` and their Kubernetes ConfigMaps from the Python source,
or check they are current.

    python -m dashboards.generate           # rewrite every dashboard file and the ConfigMaps
    python -m dashboards.generate --check   # exit 1, with a diff, when a file is stale

Run from the repository root. The JSON is committed (Grafana provisions it, see
deploy/grafana), and so are the ConfigMaps (deploy/kubernetes, see dashboards/kubernetes.py);
CI runs ``--check`` (tests/stack/test_dashboards.py).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards import blocks, clients, decisions, fleet, kubernetes, layout, traces
from dashboards.config import Config
from dashboards.panels import Board

OUT = Path(__file__).resolve().parent / "json"
BUILDERS: tuple[Callable[[Config], Board], ...] = (
    blocks.build, traces.build, layout.build, decisions.build, clients.build, fleet.build,
)


def render(cfg: Config | None = None) -> dict[str, str]:
    """File name -> JSON text of every dashboard (``<uid>.json``)."""
    cfg = cfg or Config()
    out: dict[str, str] = {}
    for build in BUILDERS:
        dash = build(cfg).build()
        name = f"{dash.uid}.json"
        if name in out:
            raise ValueError(f"two dashboards with the UID {dash.uid}")
        out[name] = json.dumps(dash, cls=JSONEncoder, indent=2, sort_keys=True,
                               ensure_ascii=False) + "\n"
    return out


def stale(out_dir: Path, files: dict[str, str]) -> list[str]:
    """Unified diffs (one per file) of what differs between ``out_dir`` and ``files``."""
    diffs = []
    present = {f.name for f in out_dir.glob("*.json")}
    for name in sorted(present | set(files)):
        if name not in files:
            diffs.append(f"{out_dir.name}/{name} is not generated: delete it\n")
            continue
        current = (out_dir / name).read_text() if name in present else ""
        wanted = files[name]
        if current != wanted:
            diffs.append("".join(difflib.unified_diff(
                current.splitlines(keepends=True), wanted.splitlines(keepends=True),
                f"{out_dir.name}/{name}", "generated")) or f"{name} differs\n")
    return diffs


def stale_configmaps(path: Path, files: dict[str, str]) -> list[str]:
    """The diff of the ConfigMaps file against what ``files`` render to, if any."""
    current = path.read_text() if path.exists() else ""
    wanted = kubernetes.render(files)
    if current == wanted:
        return []
    return ["".join(difflib.unified_diff(current.splitlines(keepends=True),
                                         wanted.splitlines(keepends=True), str(path),
                                         "generated")) or f"{path} differs\n"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboards.generate",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail when a dashboard is stale")
    ap.add_argument("--output", type=Path, default=OUT)
    ap.add_argument("--configmaps", type=Path, default=kubernetes.CONFIGMAPS,
                    help="where the Kubernetes ConfigMaps go")
    args = ap.parse_args(argv)
    files = render()
    if args.check:
        diffs = stale(args.output, files) + stale_configmaps(args.configmaps, files)
        if not diffs:
            return 0
        sys.stdout.write("".join(diffs))
        print(f"\n{args.output} is stale: run `python -m dashboards.generate` and commit it.",
              file=sys.stderr)
        return 1
    args.output.mkdir(parents=True, exist_ok=True)
    for old in args.output.glob("*.json"):
        if old.name not in files:
            old.unlink()
    for name, text in files.items():
        (args.output / name).write_text(text)
    args.configmaps.parent.mkdir(parents=True, exist_ok=True)
    args.configmaps.write_text(kubernetes.render(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
