"""docs/ARCHITECTURE.md stays a map of the code, checked against the code itself.

* Its table "Packages and who owns what" has a row for every module of
  ``iopd/`` and ``wire/`` (a row is a package, ``iopd/edge/pool/``, or a module,
  ``iopd/errors.py``; a module belongs to the row of the longest path that
  contains it), and every module over 150 lines is named in its own row, so a
  newcomer finds the room for a change in one step.
* Each row's "depends on" column is exactly what the row's modules import:
  the other rows, by their whole paths, computed with ``ast`` from the source
  (``tests/support/import_graph.py``), and the third-party packages by their
  import names.  A new import that crosses rows fails here until the map says so.
* The rows are in layer order, from the bottom up: a row imports only rows
  before it, so no package imports a package above it.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.import_graph import import_graph, module_files, third_party_imports
from tests.support.paths import ROOT

DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
LARGE = 150
SECTION = "## Packages and who owns what"
NONE = "—"


class Row:
    """One row of the table: its paths, what it owns (the text) and its "depends on"."""

    def __init__(self, line: str) -> None:
        body = line.strip().removeprefix("|").removesuffix("|")
        paths, rest = body.split(" | ", 1)
        self.owns, depends = rest.rsplit(" | ", 1)
        self.paths = re.findall(r"`([^`]+)`", paths)
        self.depends = {d.strip().strip("`") for d in depends.split(",") if d.strip() != NONE}
        self.name = ", ".join(self.paths)

    def names(self, relative: str) -> bool:
        """Whether the owns text names ``relative`` (a path inside the row) or its basename."""
        tokens = set(re.findall(r"`([^`]+)`", self.owns))
        return relative in tokens or relative.rpartition("/")[2] in tokens


def rows(doc: str = DOC) -> list[Row]:
    section = doc.split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [Row(line) for line in section.splitlines() if line.startswith("| `")]


def owner(path: str, table: list[Row]) -> tuple[Row, str] | None:
    """The row that holds the file ``path`` (whole path from the root) and the row's path."""
    best: tuple[Row, str] | None = None
    for row in table:
        for p in row.paths:
            holds = path == p if p.endswith(".py") else path.startswith(p)
            if holds and (best is None or len(p) > len(best[1])):
                best = (row, p)
    return best


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def computed_depends(table: list[Row]) -> dict[str, set[str]]:
    """Row name -> the rows' paths and the third-party packages its modules import."""
    files = module_files()
    graph = import_graph(files)
    out: dict[str, set[str]] = {row.name: set() for row in table}
    for module, path in files.items():
        held = owner(rel(path), table)
        if held is None:
            continue
        row = held[0]
        for target in graph[module]:
            other = owner(rel(files[target]), table)
            if other is not None and other[0] is not row:
                out[row.name].add(other[1])
        out[row.name] |= third_party_imports(path)
    return out


def test_every_module_has_a_row() -> None:
    table = rows()
    missing = [
        rel(path)
        for path in module_files().values()
        if owner(rel(path), table) is None and path.read_text(encoding="utf-8").strip()
    ]
    assert not missing, f"docs/ARCHITECTURE.md has no row for {missing}"


def test_every_large_module_is_named_in_its_row() -> None:
    table = rows()
    missing = []
    for path in module_files().values():
        lines = path.read_text(encoding="utf-8").count("\n")
        held = owner(rel(path), table)
        if lines > LARGE and held is not None:
            row, row_path = held
            inside = rel(path).removeprefix(row_path)
            if row_path != rel(path) and not row.names(inside):
                missing.append(f"{rel(path)} ({lines} lines) in the row {row.name}")
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"


def wrong_depends(table: list[Row], computed: dict[str, set[str]]) -> list[str]:
    """Each row whose "depends on" differs from what its modules import, and how."""
    wrong = []
    for row in table:
        if row.depends != computed[row.name]:
            wrong.append(
                f"{row.name}: the doc says {sorted(row.depends) or NONE}, the code imports "
                f"{sorted(computed[row.name]) or NONE} "
                f"(missing {sorted(computed[row.name] - row.depends)}, "
                f"not imported {sorted(row.depends - computed[row.name])})"
            )
    return wrong


def upward_imports(table: list[Row], computed: dict[str, set[str]]) -> list[str]:
    """Each row that imports a row listed after it (a layer above its own)."""
    seen: set[str] = set()
    upward = []
    for row in table:
        later = {d for d in computed[row.name] if d in row_paths(table) and d not in seen}
        if later:
            upward.append(f"{row.name} imports {sorted(later)}, listed after it")
        seen.update(row.paths)
    return upward


def row_paths(table: list[Row]) -> set[str]:
    return {p for row in table for p in row.paths}


def test_depends_on_is_the_import_graph() -> None:
    table = rows()
    wrong = wrong_depends(table, computed_depends(table))
    assert not wrong, "docs/ARCHITECTURE.md's 'depends on' is wrong:\n" + "\n".join(wrong)


def test_no_row_imports_a_row_after_it() -> None:
    table = rows()
    upward = upward_imports(table, computed_depends(table))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_config_imports_neither_edge_nor_node() -> None:
    """The node loads its config with the config layer: it must pull in no edge module."""
    graph = import_graph(module_files())
    crossing = {
        f"{module} -> {target} ({where})"
        for module, targets in graph.items()
        if module.startswith("iopd.config")
        for target, where in targets.items()
        if target.startswith(("iopd.edge", "iopd.node"))
    }
    assert not crossing, f"the config layer imports the edge or the node: {sorted(crossing)}"


def test_the_checks_see_a_wrong_row() -> None:
    """The checks themselves: a row that forgets an import, or names one after it, fails."""
    doc = (
        f"{SECTION}\n\n| path | owns | depends on |\n|---|---|---|\n"
        "| `wire/` | the protocol | msgspec |\n"
        "| `iopd/vocabulary.py` | words | — |\n"
        "## next\n"
    )
    table = rows(doc)
    assert [r.name for r in table] == ["wire/", "iopd/vocabulary.py"]
    assert table[1].depends == set()
    computed = computed_depends(table)
    assert "wire/" in computed["iopd/vocabulary.py"]  # vocabulary imports wire.messages
    assert computed["wire/"] == {"msgspec"}
    assert owner("wire/messages.py", table) == (table[0], "wire/")
    assert owner("iopd/errors.py", table) is None
    assert wrong_depends(table, computed) == [
        "iopd/vocabulary.py: the doc says —, the code imports ['wire/'] "
        "(missing ['wire/'], not imported [])"
    ]
    assert upward_imports(table, computed) == []
    upside_down = list(reversed(table))
    assert upward_imports(upside_down, computed) == [
        "iopd/vocabulary.py imports ['wire/'], listed after it"
    ]


EDGE = ROOT / "iopd" / "edge"
EDGE_ROOT_MODULES = 6
PACKAGE_MODULES = 12


def test_the_edge_is_grouped_by_concept() -> None:
    """The edge's root holds the daemon and little else; no edge folder is a flat heap."""
    root = sorted(p.name for p in EDGE.glob("*.py"))
    assert len(root) <= EDGE_ROOT_MODULES, f"iopd/edge/ holds {len(root)} modules: {root}"
    crowded = {
        rel(package): n
        for package in [EDGE, *(p for p in EDGE.rglob("*") if (p / "__init__.py").is_file())]
        if (n := len([m for m in package.glob("*.py") if m.name != "__init__.py"]))
        > PACKAGE_MODULES
    }
    assert not crowded, f"edge packages over {PACKAGE_MODULES} modules: {crowded}"
