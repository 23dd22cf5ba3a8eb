"""The package's layers, checked by walking every import (module level and inside functions).

`LAYERS` below is the one statement of the order; docs/layout.md's layer block and the README's
Layout are checked against it. No import cycle; no underscore name imported from another
module; no module imports from a layer above its own; the model, the sampler, the session and
its Ray backend do not know the maze. The benchmarks import no private name and nothing from
tests/. Each sampler fact (the vLLM import and its hint, its engine arguments, the context
length, the engine registry, where a host's engine is set) is written in one file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "workbench"
REPO = ROOT.parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("workbench", "workbench.deps", "workbench.advantages"),
    ("workbench.loggers",),
    ("workbench.envs", "workbench.model"),
    ("workbench.policy",),
    ("workbench.sampler", "workbench.vllm"),
    ("workbench.engines",),
    ("workbench.session",),
    ("workbench.storage",),
    ("workbench.cluster",),
    ("workbench.config",),
    ("workbench.run", "workbench.runfolder", "workbench.registry", "workbench.opener",
     "workbench.estimate"),
    ("workbench.rl", "workbench.jobs"),
    ("workbench.viz", "workbench.serve", "workbench.service", "workbench.notebook",
     "workbench.demo", "workbench.cli", "workbench.__main__"),
)
"""Lowest first: a module may import its own layer and those below."""

APART = {
    "workbench.envs": ("workbench.model",),
    "workbench.model": ("workbench.envs",),
    "workbench.policy": ("workbench.envs",),
    "workbench.sampler": ("workbench.envs", "workbench.vllm"),
    "workbench.vllm": ("workbench.envs", "workbench.sampler"),
    "workbench.engines": ("workbench.envs",),
    "workbench.session": ("workbench.envs",),
    "workbench.storage": ("workbench.envs",),
    "workbench.cluster": ("workbench.envs",),
}
"""Packages of the same or a higher layer that must not import these: the maze lives in envs and
above the config, the model beside it; our sampler and vLLM know nothing of each other."""


def layer_of(module: str) -> int:
    """The layer of a module: that of the longest package name it is or lies inside."""
    best = max((name for layer in LAYERS for name in layer
                if module == name or module.startswith(name + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def absolute_imports(path: Path) -> list[tuple[str, str]]:
    """(module, imported name or "") for every absolute import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, a.name) for a in node.names]
    return out


def imports_of(name: str) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every workbench import in module `name`."""
    out = []
    for module, imported in absolute_imports(MODULES[name]):
        if not module.startswith("workbench"):
            continue
        full = f"{module}.{imported}"
        out.append((full, "") if imported and full in MODULES else (module, imported))
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


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer_of(name)  # raises when no layer holds it


def test_the_layer_walk_sees_a_climb() -> None:
    assert layer_of("workbench.config") > layer_of("workbench.session.spec")
    assert layer_of("workbench.rl.rollout") > layer_of("workbench.run")


@pytest.mark.parametrize("layer", [layer[0] for layer in LAYERS])
def test_no_module_imports_from_a_higher_layer(layer: str) -> None:
    inside = [name for name in MODULES if layer_of(name) == layer_of(layer)]
    assert inside, layer
    climbs = [(name, m) for name in inside for m, _ in imports_of(name)
              if m in MODULES and layer_of(m) > layer_of(name)]
    assert climbs == []


@pytest.mark.parametrize("package", sorted(APART))
def test_the_maze_stays_above_the_session(package: str) -> None:
    inside = [name for name in MODULES if name == package or name.startswith(package + ".")]
    assert inside, package
    bad = [(name, m) for name in inside for m, _ in imports_of(name)
           if any(m == f or m.startswith(f + ".") for f in APART[package])]
    assert bad == []


# ------------------------------------------------------------ the order, as the docs state it


def as_module(word: str) -> str:
    """`envs/` or `deps.py` -> workbench.envs / workbench.deps."""
    return "workbench." + word.removesuffix("/").removesuffix(".py")


def layout_block_layers() -> list[set[str]]:
    """docs/layout.md's layer block: one layer a line that starts at the margin, its names
    before the first run of two spaces (indented lines continue the one above)."""
    text = (REPO / "docs" / "layout.md").read_text()
    block = text.split("The layers, lowest first", 1)[1].split("```\n", 2)[1]
    return [{as_module(w) for w in line.split("  ", 1)[0].split(", ")}
            for line in block.splitlines() if line and not line.startswith(" ")]


def test_the_layout_page_lists_the_layers_in_order() -> None:
    stated = [set(layer) - {"workbench", "workbench.__main__"} for layer in LAYERS]
    assert layout_block_layers() == [layer for layer in stated if layer]


def test_the_readme_names_the_layers_in_order() -> None:
    text = (REPO / "README.md").read_text()
    section = text.split("## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = [as_module(w) for w in re.findall(r"`([a-z_]+(?:/|\.py))`", section)
             if w != "workbench/"]
    assert len(named) >= 8, named
    order = [layer_of(m) for m in named]
    assert order == sorted(order), list(zip(named, order))


# ------------------------------------------------------------------------- the benchmarks

BENCHMARKS = sorted((REPO / "benchmarks").glob("*.py"))


def project_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name or "") for every import of the project's own packages in a file."""
    return [(m, n) for m, n in absolute_imports(path)
            if m.split(".")[0] in ("workbench", "benchmarks", "tests")]


def test_no_benchmark_imports_a_private_name_or_the_tests() -> None:
    found = [project_imports(p) for p in BENCHMARKS]
    assert sum(len(f) for f in found) > 30  # the walk found the imports
    bad = [(p.name, f"{m}.{n}" if n else m) for p, imports in zip(BENCHMARKS, found)
           for m, n in imports if m.split(".")[0] == "tests" or n.startswith("_")
           or any(part.startswith("_") for part in m.split("."))]
    assert bad == []


def test_the_layout_page_names_every_benchmark() -> None:
    text = (REPO / "docs" / "layout.md").read_text()
    missing = [p.name for p in BENCHMARKS if p.name != "__init__.py" and p.name not in text]
    assert missing == []


def test_each_benchmark_names_its_question_and_its_results_section() -> None:
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    headings = {m[1].strip() for m in re.finditer(r"^#{2,4} +(.+)$", results, re.M)}
    named = {}
    for path in BENCHMARKS:
        if path.name == "__init__.py":
            continue
        doc = " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
        found = re.search(r'Answers: (.+?\?) Figures: benchmarks/RESULTS\.md, "([^"]+)"\.', doc)
        named[path.name] = found[2] if found else "(no 'Answers: ...? Figures: ...' line)"
    assert {k: v for k, v in named.items() if v not in headings} == {}


# ------------------------------------------------------------ one home for each sampler fact

ONCE = {
    "def import_vllm(": "workbench/vllm/args.py",  # the import, with its install hint
    "INSTALL_HINT = ": "workbench/vllm/args.py",
    "def engine_kwargs(": "workbench/vllm/args.py",  # vLLM's engine arguments
    "def extends(": "workbench/policy/engine.py",
    "or min(model_len, DEFAULT_MAX_LEN)": "workbench/policy/engine.py",  # the context length
    "engine=make_engine(": "workbench/session/host.py",  # where a host's engine is set
    "ENGINES: dict[": "workbench/engines.py",  # the one registry of engines
    "def warn_fallback(": "workbench/deps.py",
}
"""Each sampler fact and the one file that states it."""


@pytest.mark.parametrize("text", sorted(ONCE))
def test_each_sampler_fact_is_written_once(text: str) -> None:
    homes = [str(p.relative_to(REPO)) for p in sorted(ROOT.rglob("*.py"))
             for line in p.read_text().splitlines()
             if text in line and not line.lstrip().startswith("#")]
    assert homes == [ONCE[text]]


def test_no_host_replaces_its_engine() -> None:
    assigned = [str(p.relative_to(REPO)) for p in ROOT.rglob("*.py")
                if re.search(r"host\.engine\s*=", p.read_text())]
    assert assigned == []
