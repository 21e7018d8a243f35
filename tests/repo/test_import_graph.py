"""The module graph of ``iopd/`` and ``wire/`` has no cycle, and no module is over 600 lines.

Why a test: a cycle between two modules means neither can be read, changed or
tested without the other, and Python hides it as long as one side imports
lazily (inside a function or under ``TYPE_CHECKING``).  So every import
counts here, wherever it is written: the graph is built from the source with
``ast``, never by importing anything.  The graph
(``tests/support/import_graph.py``) says how imports count.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.import_graph import (
    a_cycle,
    describe_cycles,
    import_graph,
    module_files,
    strongly_connected,
)
from tests.support.paths import ROOT

MAX_LINES = 600


def test_no_import_cycle() -> None:
    graph = import_graph(module_files())
    cycles = describe_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_cycle_finder_sees_lazy_relative_and_type_checking_imports(tmp_path: Path) -> None:
    """The finder itself: each kind of import closes a cycle it reports."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import thing\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.b import B\n"
        "thing = 1\n"
    )
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("from .a import thing\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    files = {
        "pkg": pkg / "__init__.py",
        **{f"pkg.{n}": pkg / f"{n}.py" for n in "abcd"},
    }
    graph = import_graph(files, tmp_path)
    assert strongly_connected(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert a_cycle(graph, ["pkg.a", "pkg.b", "pkg.c"]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert set(graph["pkg.b"]) == {"pkg.c"}  # ``from . import c``: the module, not the package
    assert set(graph["pkg.d"]) == {"pkg.a"}
    assert "a.py:3" in describe_cycles(graph)[0]


def test_no_module_over_600_lines() -> None:
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in module_files().values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
