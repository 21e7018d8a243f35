"""Tokens the docs and the example configs show, which no deployed config may accept.

An example copied unchanged must not open an edge to whoever read the same
example: every token string the docs, the README and ``configs/`` use (and
the usual ``change-me`` words) is listed here, and ``rules/`` refuses
it as a plain token (``openai.bearer_token``, ``node.token``) and its SHA-256
wherever a token hash is accepted (principal tokens, ``nodes[]``,
``edge.admin_token_hash_sha256``).  ``tests/config/test_placeholders.py`` scans the
docs and examples so that a new example token cannot be missing here.
Pure: no I/O, no trio.
"""

from __future__ import annotations

import hashlib
from typing import Final

__all__ = [
    "PLACEHOLDER_TOKENS",
    "is_placeholder_hash",
    "is_placeholder_token",
    "placeholder_hash_reason",
    "placeholder_token_reason",
]

#: Compared in lower case, after stripping whitespace.
PLACEHOLDER_TOKENS: Final = frozenset(
    {
        # configs/edge.yaml's and configs/node.yaml's former example tokens
        "example-app-1",
        "example-app-2",
        "example-node-a",
        "example-node-b",
        "example-laptop-alice",
        "example-token",
        # the two-daemon demo's former node token
        "demo-node-token",
        # the OpenAI SDK's api_key in the README and quickstart (any key opens the demo)
        "demo",
        "unused",
        # what people type when a field wants "something"
        "change-me",
        "changeme",
        "change_me",
        "replace-me",
        "replaceme",
        "secret",
        "password",
        "token",
        "test",
        "test-token",
        "sk-test",
        "<token>",
        "iop_...",
    }
)

#: The hex SHA-256 of each placeholder, as a config stores it.
_PLACEHOLDER_HASHES: Final = frozenset(
    hashlib.sha256(token.encode()).hexdigest() for token in PLACEHOLDER_TOKENS
)

#: What a refusal says (never the token itself: the path names the field).
PLACEHOLDER_HINT: Final = (
    "is a placeholder from the docs or examples, not a secret; run `iopd token` to make a real one"
)
PLACEHOLDER_HASH_HINT: Final = (
    "is the SHA-256 of a placeholder token from the docs or examples; "
    "run `iopd token` to make a real one"
)
#: An example's ``"<token_hash_sha256 from iopd token>"`` left in place.
ANGLE_HINT: Final = "is the example's placeholder; run `iopd token` and paste what it prints"


def is_placeholder_token(token: str) -> bool:
    """Whether a plain token is one the docs or examples show."""
    return token.strip().lower() in PLACEHOLDER_TOKENS


def is_placeholder_hash(hex_sha256: str) -> bool:
    """Whether a 64-hex token hash is the SHA-256 of a placeholder token."""
    return hex_sha256 in _PLACEHOLDER_HASHES


def placeholder_token_reason(token: str) -> str | None:
    """Why a plain token may not be used, or None."""
    return PLACEHOLDER_HINT if is_placeholder_token(token) else None


def placeholder_hash_reason(value: str) -> str | None:
    """Why a token hash or verifier is an example's, or None (its form is checked elsewhere)."""
    text = value.strip()
    if text.startswith("<") and text.endswith(">"):
        return ANGLE_HINT
    return PLACEHOLDER_HASH_HINT if is_placeholder_hash(text) else None
