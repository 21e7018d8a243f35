"""A config problem is a YAML path and a reason; this module also spells the paths.

Both the schema walk (``load.py``) and the semantic rules (``rules/``)
report problems by YAML path, and the loader drops a semantic problem at or
under a path the walk already rejected.  The record and the path spelling
live here, below both, so the dependency runs one way (load -> validate ->
problems) and the loader compares paths as values instead of parsing them
back out of ``path: reason`` text.  The text is made once, by the loader.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

__all__ = ["ConfigProblem", "join_key"]

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_.:/@+\-]+$")


class ConfigProblem(NamedTuple):
    """One problem of a config: where it is (``nodes[0].id``) and what is wrong."""

    path: str
    reason: str

    def line(self) -> str:
        """The ``YAML.PATH: reason`` line an operator reads."""
        return f"{self.path}: {self.reason}"


def _key_segment(key: object) -> str:
    """How a mapping key appears in a YAML path (``a.b``, or ``a["odd key"]``)."""
    if isinstance(key, str) and _PLAIN_KEY.match(key):
        return "." + key
    if isinstance(key, str):
        return "[" + json.dumps(key[:80]) + "]"
    return "[" + repr(key)[:80] + "]"


def join_key(path: str, key: object) -> str:
    """``path`` extended by mapping key ``key``."""
    seg = _key_segment(key)
    if not path:
        return seg[1:] if seg.startswith(".") else seg
    return path + seg
