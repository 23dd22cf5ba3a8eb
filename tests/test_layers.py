"""The package's layers, checked by walking every import (module level and inside functions):

    envs, model  <  policy  <  session  <  cluster  <  opener  <  rl  <  cli, notebook, demo, serve
    session  <  storage, run  <  runfolder  <  rl     (a run's files and folder, on disk or S3)

No import cycle; no underscore name imported from another module; the lower layers import nothing
from the higher ones; the session and its Ray backend know neither the maze nor the run config.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "workbench"

FORBIDDEN = {
    "workbench.envs": ("workbench.model", "workbench.policy", "workbench.session",
                       "workbench.cluster", "workbench.rl", "workbench.config",
                       "workbench.opener"),
    "workbench.model": ("workbench.envs", "workbench.policy", "workbench.session",
                        "workbench.cluster", "workbench.rl", "workbench.config",
                        "workbench.opener"),
    "workbench.policy": ("workbench.envs", "workbench.session", "workbench.cluster",
                         "workbench.rl", "workbench.config", "workbench.opener"),
    "workbench.session": ("workbench.envs", "workbench.cluster", "workbench.rl",
                          "workbench.config", "workbench.opener"),
    "workbench.cluster": ("workbench.envs", "workbench.rl", "workbench.config",
                          "workbench.opener"),
    "workbench.storage": ("workbench.envs", "workbench.policy", "workbench.cluster",
                          "workbench.rl", "workbench.config", "workbench.opener",
                          "workbench.run", "workbench.runfolder"),
    "workbench.run": ("workbench.cluster", "workbench.rl", "workbench.config",
                      "workbench.opener", "workbench.runfolder"),
    "workbench.runfolder": ("workbench.cluster", "workbench.rl", "workbench.opener"),
    "workbench.opener": ("workbench.rl",),
}
"""package -> what it must not import (the maze lives in envs and rl, the run config above)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every workbench import in module `name`."""
    path = MODULES[name]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("workbench")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("workbench"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.append((full, "") if full in MODULES else (node.module, a.name))
    return out


def graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in imports_of(name) if m in MODULES and m != name}
            for name in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_cycle_when_there_is_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_there_is_no_import_cycle() -> None:
    edges = graph()
    assert sum(len(e) for e in edges.values()) > 100  # the walk found the imports
    assert cycles(edges) == []


def test_no_underscore_name_is_imported_from_another_module() -> None:
    private = [(name, f"{m}.{n}") for name in MODULES for m, n in imports_of(name)
               if (n.startswith("_") or m.rsplit(".", 1)[-1].startswith("_"))]
    assert private == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_higher_ones(package: str) -> None:
    inside = [name for name in MODULES if name == package or name.startswith(package + ".")]
    assert inside, package
    bad = [(name, m) for name in inside for m, _ in imports_of(name)
           if any(m == f or m.startswith(f + ".") for f in FORBIDDEN[package])]
    assert bad == []
