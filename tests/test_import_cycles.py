"""meshrun's packages and modules import each other without cycles (issue 15): a cycle makes the
import order matter and hides which layer builds on which. Every import counts, a lazy one inside
a function too (a deferred dependency is still one)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """meshrun module -> the meshrun modules it imports anywhere in its file."""
    graph: dict[str, set[str]] = {}
    for path in (SRC / "meshrun").rglob("*.py"):
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
        graph[module_name(path)] = named
    return {module: {n for n in named if n in graph and n != module} for module, named in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def package_of(module: str) -> str:
    """meshrun.parallel.pipeline -> meshrun.parallel.parallelize; top-level modules stand for themselves."""
    return ".".join(module.split(".")[:2])


def test_the_checker_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_imports_itself_through_others() -> None:
    """E.g. metrics.trackers prints with meshrun.files.console, not with report (which builds on trackers).
    A module may use its own package's API (the package __init__, which imports the module)."""
    graph = {
        module: {other for other in imported if other != module.rsplit(".", 1)[0]}
        for module, imported in import_graph().items()
    }
    assert find_cycle(graph) is None


def leaves(graph: dict[str, set[str]]) -> set[str]:
    """Modules that build on nothing of meshrun but its errors: they sit below every layer."""
    return {module for module, imported in graph.items() if imported <= {"meshrun.errors"}}


def test_no_package_imports_itself_through_others() -> None:
    """E.g. parallel names the loss it calls by a protocol instead of importing training.

    An import of a leaf is no layering edge: `parallel.layout` (the arithmetic of ranks and axes)
    is imported by the config's own rules and by parallel's builders alike; should it ever import
    anything of meshrun, it stops being a leaf and the cycle shows here."""
    graph = import_graph()
    below_all = leaves(graph)
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(other)
            for other in imported
            if package_of(other) != package_of(module) and other not in below_all
        )
    assert find_cycle(packages) is None


def test_the_layout_object_is_a_leaf() -> None:
    assert "meshrun.parallel.layout" in leaves(import_graph())
