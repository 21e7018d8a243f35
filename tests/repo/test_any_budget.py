"""At most ``MAX_ANY`` bare ``Any`` in ``iopd/`` and ``wire/``, each with its reason.

Why a test: ``Any`` switches the type checker off for everything that flows
from it, and it creeps in wherever a value's type is not obvious at once
(a decoded JSON value, above all).  What is left is where nothing better
holds (a library without types, keyword arguments of many types, a wire
field decoded as whatever the peer sent), and each says why: a ``#``
comment on its line, or a comment line just above it.  Counted with ``ast``:
every ``Any`` name or ``typing.Any`` attribute in the code, not in strings.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.repo.test_import_graph import module_files
from tests.support.paths import ROOT

MAX_ANY = 40


def bare_any() -> list[tuple[Path, int]]:
    """``(file, line)`` of every ``Any`` used in the tree's code."""
    found: list[tuple[Path, int]] = []
    for path in module_files().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
            if name == "Any" and isinstance(node, ast.Name | ast.Attribute):
                found.append((path, node.lineno))
    return found


def has_reason(lines: list[str], lineno: int) -> bool:
    """A comment on the line, or a comment line just above it."""
    line = lines[lineno - 1]
    above = lines[lineno - 2].strip() if lineno > 1 else ""
    return "#" in line or above.startswith("#")


def test_bare_any_stays_within_its_budget() -> None:
    found = bare_any()
    shown = [f"{p.relative_to(ROOT)}:{n}" for p, n in found]
    assert len(found) <= MAX_ANY, f"{len(found)} bare Any (at most {MAX_ANY}): {shown}"


def test_each_any_says_why() -> None:
    silent = []
    for path, lineno in bare_any():
        if not has_reason(path.read_text(encoding="utf-8").splitlines(), lineno):
            silent.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert not silent, f"an Any without a reason comment on its line or above it: {silent}"


def test_the_count_sees_annotations_and_skips_text() -> None:
    source = 'from typing import Any\nx: dict[str, Any] = {}  # why\n"Any in a string"\n'
    tree = ast.parse(source)
    names = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "Any"]
    assert [n.lineno for n in names] == [2]
    assert has_reason(source.splitlines(), 2)
    assert not has_reason(["x: Any = 1"], 1)
