"""docs/ARCHITECTURE.md stays a map of the code: it names every package and
every module over 150 lines, so a newcomer finds the room for a change in
one step.  A new package or a module that grows past 150 lines fails here
until the map names it."""

from __future__ import annotations

from pathlib import Path

from tests.support.paths import ROOT

DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
LARGE = 150


def _sources() -> list[Path]:
    return sorted(p for top in ("iopd", "wire") for p in (ROOT / top).rglob("*.py"))


def test_every_package_is_named() -> None:
    packages = {p.parent.relative_to(ROOT).as_posix() for p in _sources()}
    missing = sorted(pkg for pkg in packages if pkg not in DOC)
    assert not missing, f"docs/ARCHITECTURE.md does not name the packages {missing}"


def test_every_large_module_is_named() -> None:
    missing = []
    for path in _sources():
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > LARGE and path.name not in DOC:
            missing.append(f"{path.relative_to(ROOT).as_posix()} ({lines} lines)")
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"
