"""The package's import graph, read from the source with ``ast`` (nothing is imported):
no cycles, no imports of workhorse modules hidden inside functions of the client API
modules, and an ambient-state module that imports nothing of the package.

Edges are runtime imports between workhorse modules, at module level or inside functions;
imports under ``if TYPE_CHECKING:`` are not edges. ``from pkg import name`` is an edge to
the submodule ``pkg.name`` when there is one, else to ``pkg``. The parent packages that
Python runs before a module are not edges: every module would otherwise depend on
``workhorse/__init__.py``, which imports the public API.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .conftest import ROOT

PACKAGE = ROOT / "workhorse"
#: Modules whose functions may not import workhorse modules (issue 11).
NO_FUNCTION_IMPORTS = ("workhorse.app", "workhorse.canvas", "workhorse.result",
                       "workhorse.task", "workhorse.chords")
AMBIENT_STATE = "workhorse._state"


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, in_function: bool = False
             ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that runs at some point, and whether it is inside a function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]), in_function)
        else:
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            yield from _imports(child, nested)


def _targets(statement: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: dict[str, Path]) -> Iterator[str]:
    if isinstance(statement, ast.Import):
        for alias in statement.names:
            if alias.name in known:
                yield alias.name
        return
    if statement.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (statement.level - 1)]
        origin = ".".join([*base, *([statement.module] if statement.module else [])])
    else:
        origin = statement.module or ""
    for alias in statement.names:
        submodule = f"{origin}.{alias.name}"
        if submodule in known:
            yield submodule
        elif origin in known:
            yield origin


def import_edges() -> list[Edge]:
    known = module_names()
    edges: dict[tuple[str, str, int], Edge] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for statement, in_function in _imports(tree):
            for target in _targets(statement, module, path.name == "__init__.py", known):
                if target != module:
                    edges[module, target, statement.lineno] = Edge(
                        module, target, path, statement.lineno, in_function)
    return list(edges.values())


@dataclass(frozen=True)
class Tangle:
    """Modules that all import each other, directly or not, and one cycle among them."""

    modules: frozenset[str]
    cycle: list[Edge]

    def __str__(self) -> str:
        return f"{describe(self.cycle)}\n  (all in cycles: {', '.join(sorted(self.modules))})"


def find_cycles(edges: list[Edge]) -> list[Tangle]:
    """Each strongly connected component with more than one module (Tarjan), and a
    shortest cycle in it."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
        graph.setdefault(edge.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph[node]:
            if edge.target not in index:
                connect(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [Tangle(frozenset(c), _cycle_in(c, graph)) for c in components]


def _cycle_in(component: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    paths: dict[str, list[Edge]] = {start: []}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for edge in graph[node]:
            if edge.target == start:
                return [*paths[node], edge]
            if edge.target in component and edge.target not in paths:
                paths[edge.target] = [*paths[node], edge]
                queue.append(edge.target)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def describe(cycle: list[Edge]) -> str:
    steps = " -> ".join(f"{e.source} ({e.where()}{', in a function' if e.in_function else ''})"
                        for e in cycle)
    return f"{steps} -> {cycle[0].source}"


def test_the_package_import_graph_has_no_cycles():
    tangles = find_cycles(import_edges())
    assert not tangles, "import cycles:\n" + "\n".join(map(str, tangles))


def test_client_modules_import_nothing_of_workhorse_inside_functions():
    hidden = [f"{e.where()}: {e.source} imports {e.target} inside a function"
              for e in import_edges() if e.source in NO_FUNCTION_IMPORTS and e.in_function]
    assert not hidden, "function-level imports:\n" + "\n".join(hidden)


def test_the_ambient_state_module_imports_nothing_of_workhorse():
    assert AMBIENT_STATE in module_names(), f"{AMBIENT_STATE} is missing"
    imports = [f"{e.where()}: imports {e.target}" for e in import_edges()
               if e.source == AMBIENT_STATE]
    assert not imports, "\n".join(imports)


def test_the_graph_sees_cycles_through_function_level_imports():
    """The checker itself: a cycle closed only inside a function is still a cycle."""
    here = Path(__file__)
    edges = [Edge("a", "b", here, 1, False), Edge("b", "c", here, 2, False),
             Edge("c", "a", here, 3, True), Edge("c", "d", here, 4, False)]
    [tangle] = find_cycles(edges)
    assert tangle.modules == {"a", "b", "c"}
    assert describe(tangle.cycle) == (
        "a (tests/test_import_graph.py:1) -> b (tests/test_import_graph.py:2) -> "
        "c (tests/test_import_graph.py:3, in a function) -> a")


def test_type_checking_imports_are_not_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from .app import App\nelse:\n    from .task import Task\n"
                     "def f():\n    from .result import AsyncResult\n")
    found = [(s.module, inside) for s, inside in _imports(tree)
             if isinstance(s, ast.ImportFrom) and s.level]
    assert found == [("task", False), ("result", True)]
