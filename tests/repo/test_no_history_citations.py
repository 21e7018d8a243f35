"""The code carries its reasons, not pointers to documents a reader cannot open.

A comment or docstring that cites a section of a spec or the number of an
issue instead of saying the rule sends the reader to a text the repository
does not hold.  Every ``.py`` file under the code and test trees is read as
text, so comments, docstrings, log text and user-visible strings all count.
The rule a citation pointed at goes into the comment itself or into a
section of ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TREES = ("iopd", "wire", "scripts", "tests")

# Built from pieces so this file's own source never matches them.
_SPEC = "SPEC" + r"\s*" + "\u00a7"
_ISSUE = "issue" + r"s?\s*#\s*\d"
CITATION = re.compile(f"{_SPEC}|{_ISSUE}", re.IGNORECASE)


def citations(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of ``text`` that cites a spec section or an issue."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if CITATION.search(line)
    ]


def test_the_pattern_finds_both_kinds_of_citation() -> None:
    spec, issue = "SPEC " + "\u00a7" + "3", "Issue " + "#" + "16"
    assert citations(f"x = 1\n# relayed as is ({spec})\n") == [(2, f"# relayed as is ({spec})")]
    assert citations(f'"""Retries ({issue}): a run that fails."""') != []
    assert citations("issues " + "#17, #21") != []
    assert citations("# RFC 9112 \u00a72.2; see docs/reliability.md, case 5") == []


def test_no_python_file_cites_a_spec_section_or_an_issue() -> None:
    found = []
    for tree in TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            for number, line in citations(path.read_text(encoding="utf-8")):
                found.append(f"{path.relative_to(REPO)}:{number}: {line}")
    assert found == [], "say the reason, or point to a section of docs/:\n" + "\n".join(found)
