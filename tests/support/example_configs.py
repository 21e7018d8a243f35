"""The shipped example configs, as an operator fills them in before a first start.

``configs/*.yaml`` hold ``"<token_hash_sha256 from iopd token>"`` (and the
verifier's twin) where a deployment needs a secret of its own: the unchanged
files do not validate.  ``filled_example`` puts a fresh random hash or
verifier in each place, as ``iopd token`` would, and ``EXAMPLE_ENV`` is the
environment the node examples read their token from.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path

from tests.support.paths import ROOT
from wire import scram

CONFIGS = ROOT / "configs"
PLACEHOLDER = re.compile(r'"<(token_hash_sha256|token_verifier) from iopd token>"')
#: What the node examples read (``node.token: ${IOP_NODE_TOKEN...}``).
EXAMPLE_ENV = {"IOP_NODE_TOKEN": secrets.token_urlsafe(32)}


def _fill(match: re.Match[str]) -> str:
    token = secrets.token_urlsafe(32)
    if match.group(1) == "token_verifier":
        verifier = scram.Verifier.create(token, iterations=scram.MIN_ITERATIONS)
        return f'"{verifier.encode()}"'
    return hashlib.sha256(token.encode()).hexdigest()


def filled_example(name: str) -> str:
    """``configs/NAME`` with every placeholder replaced by a fresh secret's hash or verifier."""
    return PLACEHOLDER.sub(_fill, (CONFIGS / name).read_text())


def write_filled_example(name: str, directory: Path) -> Path:
    """``filled_example(name)`` written to ``directory/name``; its path."""
    path = directory / name
    path.write_text(filled_example(name))
    return path
