"""The collector every rule writes to: ``Errors`` (problems in the order found,
with the checks several sections share: bounds, ids sent in a handshake,
addresses, token hashes, TLS pairs) and ``first_at`` (where a key was first
defined, for duplicate ids)."""

from __future__ import annotations

import math
import re

from iopd.config.addresses import parse_host_port
from iopd.config.placeholders import placeholder_hash_reason, placeholder_token_reason
from iopd.config.problems import ConfigProblem
from wire.framing import MAX_HANDSHAKE_ID_CHARS

__all__ = ["HEX64", "Errors", "first_at"]

HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HASH_HINT = "must be 64 lowercase hex characters (the SHA-256 of the token; see 'iopd token')"


class Errors:
    """Collects the problems found, in the order found."""

    def __init__(self) -> None:
        self.problems: list[ConfigProblem] = []

    def add(self, path: str, reason: str) -> None:
        self.problems.append(ConfigProblem(path, reason))

    def positive(self, path: str, value: float) -> None:
        if not value > 0 or (isinstance(value, float) and math.isnan(value)):
            self.add(path, f"must be > 0 (got {value})")

    def non_negative(self, path: str, value: float) -> None:
        if not value >= 0:
            self.add(path, f"must be >= 0 (got {value})")

    def not_empty(self, path: str, value: str) -> bool:
        if not value.strip():
            self.add(path, "must not be empty")
            return False
        return True

    def wire_id(self, path: str, value: str) -> bool:
        """An id sent in a handshake frame: not empty, and short enough for its frame cap."""
        if len(value) > MAX_HANDSHAKE_ID_CHARS:
            self.add(
                path, f"must be at most {MAX_HANDSHAKE_ID_CHARS} characters (got {len(value)})"
            )
            return False
        return self.not_empty(path, value)

    def address(self, path: str, value: str) -> str | None:
        try:
            host, _ = parse_host_port(value)
        except ValueError as exc:
            self.add(path, f"{exc} (got {value[:80]!r})")
            return None
        return host

    def hash64(self, path: str, value: str) -> bool:
        """A token hash: 64 lowercase hex, and not the hash of an example's token."""
        reason = placeholder_hash_reason(value) or (None if HEX64.match(value) else _HASH_HINT)
        if reason:
            self.add(path, reason)
        return reason is None

    def real_token(self, path: str, value: str) -> None:
        """A plain token (``openai.bearer_token``, ``node.token``): not an example's."""
        if reason := placeholder_token_reason(value):
            self.add(path, reason)

    def tls_pair(self, path: str, cert: str | None, key: str | None) -> None:
        if cert and not key:
            self.add(f"{path}.key", f"required when {path}.cert is set")
        if key and not cert:
            self.add(f"{path}.cert", f"required when {path}.key is set")


def first_at(seen: dict[str, str], key: str, path: str) -> str | None:
    """Where ``key`` was first defined, or None (recording ``path``) the first time."""
    first = seen.get(key)
    if first is None:
        seen[key] = path
    return first
