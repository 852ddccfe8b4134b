"""The answer as JSON: the shape ``explain.schema.json`` documents (``kvscope.explain/1``)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def schema() -> dict[str, Any]:
    """The JSON Schema of every JSON answer ($defs/answer, $defs/worst)."""
    return json.loads((resources.files("kvscope.explain") / "explain.schema.json").read_text())


def dumps(answer: dict[str, Any]) -> str:
    return json.dumps(answer, indent=1, default=str)
