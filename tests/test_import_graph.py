"""Import-graph hygiene for the project's packages.

Walks every module of ``dynts``, ``trainers``, ``eval`` and ``data_pipeline`` with :mod:`ast`
(imports inside functions included, relative imports resolved, ``if TYPE_CHECKING:`` blocks
skipped) and fails on

* a ``_private`` name (one leading underscore, not a dunder) imported from another module of
  these packages, and
* an import circle between two or more modules (lazy imports count: a circle hidden in a
  function is still a circle), and
* an import that goes the wrong way between rooms (``ROOM_MAY_IMPORT``, the layering drawn in
  ``docs/architecture.md``), or an ``eval`` module outside the four rooms.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dynts", "trainers", "eval", "data_pipeline")
# room -> the rooms its modules may import (besides itself). dynts is the floor; eval is split by job.
ROOM_MAY_IMPORT = {
    "dynts": set(),
    "data_pipeline": {"dynts"},
    "trainers": {"dynts", "data_pipeline"},
    "eval": set(),  # eval/__init__.py: a docstring only
    "eval.harness": {"dynts", "data_pipeline"},
    "eval.analyses": {"dynts", "data_pipeline", "trainers", "eval.harness"},
    "eval.rescue": {"dynts", "data_pipeline", "trainers", "eval.harness"},
    "eval.perf": {"dynts"},
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def discover_modules(root: Path = ROOT) -> dict[str, Path]:
    """Map dotted module name -> source file for every ``.py`` file of PACKAGES under root."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            modules[_module_name(path, root)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Yield every Import/ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _resolve_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that is ``name`` or a parent package of it."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path]):
    """Return ``(edges, private_imports)``.

    edges: module -> set of project modules it imports (package ``__init__`` included when a
    submodule is imported, as Python executes it). private_imports: list of
    ``"importer: from target import _name"`` strings.
    """
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _import_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_base(module, is_package, node)
                for alias in node.names:
                    full = f"{base}.{alias.name}" if base else alias.name
                    if full in modules:  # ``from pkg import submodule``
                        targets.append(full)
                        continue
                    targets.append(base)
                    if alias.name != "*" and _is_private(alias.name) and _owner(base, modules):
                        private.append(f"{module}: from {base} import {alias.name}")
            for target in targets:
                owner = _owner(target, modules)
                if owner is None:
                    continue
                # importing a.b.c runs a/__init__ and a/b/__init__ too
                parts = owner.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in modules and dep != module and not module.startswith(dep + "."):
                        edges[module].add(dep)
    return edges, private


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_cycle_path(c, edges) for c in components]


def _cycle_path(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """One concrete circle inside a strongly connected component (BFS back to the start)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def room(module: str) -> str:
    """``eval.harness.runner`` -> ``eval.harness``; ``dynts.rescue.engine`` -> ``dynts``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "eval" and len(parts) > 1 else parts[0]


def wrong_way_imports(edges: dict[str, set[str]]) -> list[str]:
    """Every edge ``a -> b`` whose rooms are different and not allowed by ROOM_MAY_IMPORT."""
    bad = []
    for module, targets in sorted(edges.items()):
        allowed = ROOM_MAY_IMPORT.get(room(module))
        if allowed is None:
            bad.append(f"{module}: not in any room of ROOM_MAY_IMPORT")
            continue
        bad += [f"{module} -> {target}" for target in sorted(targets)
                if room(target) != room(module) and room(target) not in allowed]
    return bad


@pytest.fixture(scope="module")
def graph():
    return import_graph(discover_modules())


def test_discovers_every_package(graph):
    edges, _ = graph
    for package in PACKAGES:
        assert package in edges, f"{package}/__init__.py not found"
    assert "dynts.generate" in edges and "eval.harness.runner" in edges


def test_no_private_imports_across_modules(graph):
    _, private = graph
    assert not private, "private names imported across modules:\n" + "\n".join(sorted(private))


def test_no_import_circles(graph):
    edges, _ = graph
    cycles = find_cycles(edges)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_go_one_way_between_rooms(graph):
    edges, _ = graph
    bad = wrong_way_imports(edges)
    assert not bad, "imports against the layering of ROOM_MAY_IMPORT:\n" + "\n".join(bad)


def test_layering_checker_catches_a_wrong_way_import_and_a_module_outside_the_rooms():
    edges = {"dynts.generate": {"eval.harness.runner"}, "eval.harness.runner": {"dynts.generate"},
             "eval.rescue.bench": {"eval.analyses.pareto", "eval.harness.prompts"}, "eval.loose": set()}
    assert wrong_way_imports(edges) == [
        "dynts.generate -> eval.harness.runner", "eval.loose: not in any room of ROOM_MAY_IMPORT",
        "eval.rescue.bench -> eval.analyses.pareto"]


def test_checker_catches_a_circle_and_a_private_import(tmp_path):
    pkg = tmp_path / "dynts"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from dynts.a import f\nfrom .c import _hidden\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n_hidden = 1\n")
    for other in PACKAGES[1:]:
        (tmp_path / other).mkdir()
        (tmp_path / other / "__init__.py").write_text("")
    edges, private = import_graph(discover_modules(tmp_path))
    assert private == ["dynts.b: from dynts.c import _hidden"]
    assert find_cycles(edges) == [["dynts.a", "dynts.b", "dynts.a"]]
