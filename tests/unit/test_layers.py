"""Every module of the kvscope package imports only its own layer or the layers below it.

The layers, bottom up (the README's "Layout of the repository" draws the same picture):
the probe (``kvscope_probe``, its own distribution) and the shared helpers -> rows -> state
-> sinks -> stores (store, decisions) -> layout -> explain (one request's story, read
from the store) -> sidecar ingest -> exposition -> HTTP -> the sidecar's server and config
-> twin -> the programs (whatif, explain's counterfactual and command, demo, loadgen, the
client SDK, the local vLLM launcher) -> cli. The layout package sits below the sidecar
because ``kvscope serve`` samples the pool's layout and serves its page; it reads the state
only. Imports are read with ``ast`` from the source (those inside functions and under
``TYPE_CHECKING`` included), so a lazy import cannot hide an upward edge.

The probe's own modules are not checked here: ``exporter/kvscope_probe`` belongs to its
own distribution and its own tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.astparse import parse

ROOT = Path(__file__).resolve().parents[2] / "exporter"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("helpers", ("kvscope", "kvscope.errors", "kvscope.times", "kvscope.redact", "kvscope.settings",
                 "kvscope.procs", "kvscope.os_thread", "kvscope.http", "kvscope.models",
                 "kvscope.throttle", "kvscope.metric_table")),
    ("rows", ("kvscope.rows",)),
    ("state", ("kvscope.state",)),
    ("sinks", ("kvscope.sinks",)),
    ("stores", ("kvscope.store", "kvscope.decisions")),
    ("layout", ("kvscope.layout",)),
    ("explain", ("kvscope.explain",)),
    ("ingest", ("kvscope.sidecar.ingest",)),
    ("exposition", ("kvscope.sidecar.exposition",)),
    ("http", ("kvscope.sidecar.http",)),
    ("sidecar", ("kvscope.sidecar",)),
    ("twin", ("kvscope.twin",)),
    ("programs", ("kvscope.whatif", "kvscope.explain.counterfactual", "kvscope.explain.cli",
                  "kvscope.demo", "kvscope.load",
                  "kvscope.client", "kvscope.localvllm")),
    ("cli", ("kvscope.cli", "kvscope.__main__", "kvscope.commands")),
]
"""Layer name and the modules or packages it holds; a module belongs to its longest prefix
(``kvscope`` itself only to its ``__init__``)."""


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the kvscope package under ``root``."""
    found = {}
    for path in sorted((root / "kvscope").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvscope modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m == "kvscope" or m.startswith("kvscope.")}


def home(name: str) -> tuple[int, str] | None:
    """(index into LAYERS, prefix) of the longest prefix that holds ``name``; None for none."""
    best: tuple[int, str] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix == "kvscope"
            if name == prefix or (not exact_only and name.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    return best


def layer_of(name: str) -> int | None:
    """Index into LAYERS of the layer that holds ``name``; None for no layer."""
    found = home(name)
    return None if found is None else found[0]


def violations(root: Path) -> list[str]:
    """Every import of a higher layer or of a module that does not exist (a path left behind
    by a move), and every module that has no layer."""
    found = modules(root)
    problems = []
    for name, path in found.items():
        mine = layer_of(name)
        if mine is None:
            problems.append(f"{name}: in no layer (add it to LAYERS and the README)")
            continue
        for target in sorted(imports(name, path, set(found))):
            if target not in found:
                problems.append(f"{name} imports {target}, which is no module (moved?)")
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                problems.append(f"{name} ({LAYERS[mine][0]}) imports {target} "
                                f"({LAYERS[theirs][0]})")
    return problems


def package_cycles(root: Path) -> list[list[str]]:
    """Cycles between the packages of LAYERS (``kvscope.layout``, ``kvscope.sidecar.http``...)."""
    found = modules(root)

    def package(name: str) -> str:
        found_home = home(name)
        return name if found_home is None else found_home[1]

    edges: dict[str, set[str]] = {}
    for name, path in found.items():
        for target in imports(name, path, set(found)):
            if package(target) != package(name):
                edges.setdefault(package(name), set()).add(package(target))
    cycles, done = [], set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycles.append(trail[trail.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, trail + [node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])
    return cycles


def test_no_module_imports_a_higher_layer() -> None:
    assert violations(ROOT) == []


def test_no_two_packages_import_each_other() -> None:
    assert package_cycles(ROOT) == []


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """A state module that imports the sidecar is reported, lazy import included."""
    state = tmp_path / "kvscope" / "state"
    state.mkdir(parents=True)
    (tmp_path / "kvscope" / "__init__.py").write_text("")
    (state / "__init__.py").write_text("")
    (state / "hub.py").write_text("def f():\n    from kvscope.sidecar import server\n")
    sidecar = tmp_path / "kvscope" / "sidecar"
    sidecar.mkdir()
    (sidecar / "__init__.py").write_text("")
    (sidecar / "server.py").write_text("from kvscope.state import hub\n")
    assert violations(tmp_path) == [
        "kvscope.state.hub (state) imports kvscope.sidecar.server (sidecar)"]
    assert package_cycles(tmp_path) == [
        ["kvscope.sidecar", "kvscope.state", "kvscope.sidecar"]]


def test_the_checker_sees_an_import_of_a_moved_module(tmp_path: Path) -> None:
    """An import of a path that no longer exists is reported, not skipped as outside kvscope."""
    state = tmp_path / "kvscope" / "state"
    state.mkdir(parents=True)
    (tmp_path / "kvscope" / "__init__.py").write_text("")
    (state / "__init__.py").write_text("")
    (state / "hub.py").write_text("from kvscope.sidecar.engine import EngineState\n")
    assert violations(tmp_path) == [
        "kvscope.state.hub imports kvscope.sidecar.engine, which is no module (moved?)"]
