"""Dockerfiles checked without a Docker engine.

What a build can get wrong before it runs: a COPY source that does not exist or that the
Dockerfile's own ``.dockerignore`` keeps out of the context, and a local project installed
without the local projects it depends on (the build has no other source for them: pip
would look for them on PyPI and fail).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.stack.composespec import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (pip's own dependency)
    import tomli as tomllib


def check_copies(context: Path, dockerfile: Path) -> None:
    """Every COPY source exists and gets past the Dockerfile's own .dockerignore."""
    ignore = Path(f"{dockerfile}.dockerignore")
    assert ignore.is_file(), f"{ignore} keeps .venv and models out of the build context"
    rules = [r for r in ignore.read_text().splitlines() if r and not r.startswith("#")]
    for srcs, _ in copies(dockerfile):
        for src in srcs:
            assert (context / src).exists(), (dockerfile, src)
            excluded = False
            for rule in rules:
                pattern = rule.lstrip("!").rstrip("/")
                if fnmatch.fnmatch(src.rstrip("/"), pattern):
                    excluded = not rule.startswith("!")
            assert not excluded, f"{dockerfile}: COPY {src} is excluded by {ignore.name}"


def copies(dockerfile: Path) -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY from the build context (not ``--from``)."""
    out = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            words = line.split()[1:]
            out.append((words[:-1], words[-1]))
    return out


def _commands(dockerfile: Path) -> list[str]:
    """RUN commands with their continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def local_projects(dockerfile: Path, context: Path = ROOT) -> list[Path]:
    """Projects of the build context that the Dockerfile's ``pip install``s name by path."""
    found = []
    for cmd in _commands(dockerfile):
        for part in cmd.split("&&"):
            words = shlex.split(part)
            if "pip" not in words or "install" not in words:
                continue
            for word in words:
                if word.startswith("/"):
                    path = _context_path(dockerfile, context, word.split("[")[0].rstrip("/"))
                    if path is not None:
                        found.append(path)
    return found


def _context_path(dockerfile: Path, context: Path, image_path: str) -> Path | None:
    for srcs, dst in copies(dockerfile):
        dst = dst.rstrip("/")
        if len(srcs) > 1 and image_path == dst and "pyproject.toml" in srcs:
            return context
        if len(srcs) == 1 and (image_path == dst or image_path.startswith(dst + "/")):
            return context / srcs[0] / image_path[len(dst) + 1:]
    return None


def _project(path: Path) -> tuple[str, list[str]]:
    meta = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    deps = [canonicalize_name(Requirement(d).name) for d in meta.get("dependencies", [])]
    return canonicalize_name(meta["name"]), deps


def missing_local_dependencies(dockerfile: Path, context: Path = ROOT) -> list[str]:
    """Local distributions that a locally installed project needs and the image lacks."""
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "**/pyproject.toml"],
                             cwd=context, capture_output=True, text=True, check=True).stdout
    local = {_project(p.parent)[0]: p.parent for p in map(context.joinpath, tracked.split())}
    installed = {_project(p)[0]: _project(p)[1] for p in local_projects(dockerfile, context)}
    return sorted(f"{name} needs {dep} ({local[dep].relative_to(context)})"
                  for name, deps in installed.items() for dep in deps
                  if dep in local and dep not in installed)
