"""Named LogQL queries from ``.logql`` files: ``# name: X``, comment lines, one query line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NamedQuery:
    name: str
    doc: str
    query: str


def read_queries(path: Path) -> list[NamedQuery]:
    out: list[NamedQuery] = []
    name, doc = None, []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("# name:"):
            name, doc = line.split(":", 1)[1].strip(), []
        elif line.startswith("#"):
            if name:
                doc.append(line.lstrip("# "))
        elif line and name:
            out.append(NamedQuery(name, " ".join(doc), line))
            name, doc = None, []
    return out
