"""Every module of ``iopd/`` over ``MIN_LINES`` lines has a test that imports it directly.

Why a test: a module tested only through others (end to end, or through a
package's re-exports) is one whose own contract nobody wrote down; when it
breaks, the failing test names something else.  "Directly": a test file's
``import`` or ``from`` names the module itself (``from iopd.edge.pool.pool
import ProviderPool``, not ``from iopd.edge.pool import ProviderPool``).
Found from the source with ``ast``, never by importing.

Where a direct test makes no sense, the module is in ``WITHOUT_DIRECT_TEST``
with the reason; an entry that no longer needs to be there (the module got
its test, or shrank) fails too, so the list stays short and true.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.repo.test_import_graph import module_files
from tests.support.paths import ROOT

MIN_LINES = 150

#: Modules over ``MIN_LINES`` lines without a test of their own, and why.
WITHOUT_DIRECT_TEST: dict[str, str] = {}


def imported_by_tests(tests: Path) -> set[str]:
    """Every dotted name a test file's imports name: ``import a.b``, ``from a.b
    import c`` (``a.b``, and ``a.b.c`` in case ``c`` is a module)."""
    names: set[str] = set()
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def large_modules() -> dict[str, int]:
    """The ``iopd`` modules over ``MIN_LINES`` lines, with their line counts."""
    out: dict[str, int] = {}
    for name, path in module_files().items():
        if name == "iopd" or name.startswith("iopd."):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MIN_LINES:
                out[name] = lines
    return out


def test_every_large_module_has_a_direct_test_or_a_reason() -> None:
    imported = imported_by_tests(ROOT / "tests")
    missing = sorted(
        f"{name} ({lines} lines)"
        for name, lines in large_modules().items()
        if name not in imported and name not in WITHOUT_DIRECT_TEST
    )
    assert not missing, (
        "no test imports these modules directly: write one in the mirroring tests/ "
        f"folder, or say in WITHOUT_DIRECT_TEST why not: {missing}"
    )


def test_the_list_of_exceptions_is_current() -> None:
    imported = imported_by_tests(ROOT / "tests")
    large = large_modules()
    stale = sorted(name for name in WITHOUT_DIRECT_TEST if name in imported or name not in large)
    assert not stale, f"tested directly now, or no longer over {MIN_LINES} lines: {stale}"
    assert all(reason.strip() for reason in WITHOUT_DIRECT_TEST.values())


def test_what_counts_as_a_direct_import(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import iopd.tokens\n"
        "from iopd.edge.pool import pool\n"
        "from iopd.edge import metering\n"
        "from . import local\n",
        encoding="utf-8",
    )
    (tmp_path / "helper.py").write_text("import iopd.redact\n", encoding="utf-8")  # no test file
    names = imported_by_tests(tmp_path)
    assert {"iopd.tokens", "iopd.edge.pool.pool", "iopd.edge.metering"} <= names
    assert "iopd.redact" not in names and "local" not in names
