"""The module graph of ``iopd/`` and ``wire/``, built from the source with ``ast`` (nothing is
imported): every module by dotted name, the imports of each with their file:line, the
third-party packages a file imports, and the import cycles.

Edges: ``import a.b`` imports ``a.b``; ``from a import b`` imports ``a.b`` when that is a
module of the tree, else ``a``; relative imports are resolved against the importing module's
package.  Importing ``a.b`` does not count as importing the package ``a`` (Python runs
``a/__init__.py`` first, but a package that re-exports its modules is not a cycle with them).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import ROOT

PACKAGES = ("iopd", "wire")


def module_files() -> dict[str, Path]:
    """Every module of the tree by dotted name (a package by its ``__init__``)."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, modules: set[str]) -> dict[str, int]:
    """The modules of the tree that ``module`` imports -> line of the first such import."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        while name and name not in modules:  # ``import a.b.attr`` -> ``a.b``
            name = name.rpartition(".")[0]
        if name and name != module:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]  # level 1 is ``package``
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                name = f"{base}.{alias.name}"
                # ``from a import b`` imports the module ``a.b`` if there is one, else ``a``.
                add(name if name in modules else base, node.lineno)
    return found


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the packages outside the tree and the standard library it imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    return {
        n for n in names if n not in sys.stdlib_module_names and n not in (*PACKAGES, "__future__")
    }


def import_graph(files: dict[str, Path], root: Path = ROOT) -> dict[str, dict[str, str]]:
    """module -> {imported module of the tree -> ``file:line`` of the first such import}."""
    modules = set(files)
    return {
        module: {
            target: f"{path.relative_to(root)}:{line}"
            for target, line in imports_of(module, path, modules).items()
        }
        for module, path in files.items()
    }


def strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def a_cycle(graph: dict[str, dict[str, str]], component: list[str]) -> list[str]:
    """One concrete cycle through the first module of ``component``, as a path."""
    inside = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child in inside and child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def describe_cycles(graph: dict[str, dict[str, str]]) -> list[str]:
    """Each cycle as ``a -> b -> a`` with the file:line of each import."""
    out = []
    for component in strongly_connected(graph):
        cycle = a_cycle(graph, component)
        steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        out.append(
            " -> ".join(cycle)
            + f"\n    component: {', '.join(component)}\n    "
            + "\n    ".join(steps)
        )
    return out
