"""SCRAM-SHA-256 (RFC 5802 / RFC 7677) for the node handshake: the math and the verifier.

Why SCRAM: the node proves it knows its token without sending it, over fresh
nonces from both sides, so a recorded handshake proves nothing later; the edge
keeps only a *verifier* (salt, iterations, StoredKey, ServerKey) from which
the token cannot be derived and with which nobody can compute a proof; and
the edge proves in return that it holds the verifier (the server signature),
so a node knows it reached an edge that was given its verifier.  A salt drawn
per verifier (and so per edge config) means a proof made for one edge is
useless at another.

The messages follow the RFC's text forms exactly (so RFC 7677's test vector
checks this module end to end); on the wire they travel as fields of
``Hello``/``Challenge``/``Proof``/``HelloAck`` and the ``AuthMessage`` is
rebuilt from those fields on both sides:

* client-first-message-bare: ``n=<node id>,r=<client nonce>``
* server-first-message: ``r=<client nonce><server nonce>,s=<base64 salt>,i=<iterations>``
* client-final-message-without-proof: ``c=biws,r=<nonce>`` (no channel binding)

Differences from the RFC, on purpose: the token is used as UTF-8 bytes
without SASLprep (tokens are ASCII); the node id is escaped as a saslname
(``=`` -> ``=3D``, ``,`` -> ``=2C``).

Pure: hashlib, hmac and secrets only; nothing here does I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

MECHANISM = "SCRAM-SHA-256"
#: Iterations of a verifier made by ``iopd token`` (RFC 7677 asks for >= 4096).
DEFAULT_ITERATIONS = 100_000
#: The fewest iterations an edge may ask for, and the most a node computes
#: (a hostile edge could otherwise make a node hash for minutes).
MIN_ITERATIONS = 4096
MAX_ITERATIONS = 1_000_000
#: Random bytes behind a nonce (base64: 24 printable characters) and a salt.
NONCE_BYTES = 18
SALT_BYTES = 16
#: Bounds of a nonce or salt a peer sends (checked before any work).
MIN_NONCE_CHARS = 16
MAX_NONCE_CHARS = 128
MAX_SALT_BYTES = 64

_NONCE = re.compile(r"^[\x21-\x2b\x2d-\x7e]+$")  # printable ASCII but ','
_VERIFIER = re.compile(
    r"^SCRAM-SHA-256\$(?P<iterations>[0-9]{1,8}):(?P<salt>[A-Za-z0-9+/=]{1,100})"
    r"\$(?P<stored>[A-Za-z0-9+/=]{44}):(?P<server>[A-Za-z0-9+/=]{44})$"
)
VERIFIER_FORMAT = "SCRAM-SHA-256$<iterations>:<base64 salt>$<base64 StoredKey>:<base64 ServerKey>"


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def salted_password(secret: str, salt: bytes, iterations: int) -> bytes:
    """``Hi(secret, salt, i)``: PBKDF2-HMAC-SHA-256.  The one costly step (CPU bound)."""
    return hashlib.pbkdf2_hmac("sha256", secret.encode("utf-8", "surrogatepass"), salt, iterations)


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a token: what an edge's ``token_hash_sha256`` holds, and
    the secret a node keys its proof with when the edge holds only that."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def client_key(salted: bytes) -> bytes:
    return _hmac(salted, b"Client Key")


def server_key(salted: bytes) -> bytes:
    return _hmac(salted, b"Server Key")


def new_nonce() -> str:
    """A fresh nonce: base64 of ``NONCE_BYTES`` random bytes (never contains ',')."""
    return _b64(secrets.token_bytes(NONCE_BYTES))


def nonce_problem(nonce: str) -> str | None:
    """Why a peer's nonce cannot be used, or None (length and characters, RFC 5802)."""
    if not MIN_NONCE_CHARS <= len(nonce) <= MAX_NONCE_CHARS:
        return f"nonce must be {MIN_NONCE_CHARS}..{MAX_NONCE_CHARS} characters"
    if not _NONCE.match(nonce):
        return "nonce must be printable ASCII without ','"
    return None


def _saslname(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


def auth_message(
    node_id: str, client_nonce: str, nonce: str, salt: bytes, iterations: int
) -> bytes:
    """The RFC 5802 ``AuthMessage`` both sides sign (see the module docstring)."""
    client_first_bare = f"n={_saslname(node_id)},r={client_nonce}"
    server_first = f"r={nonce},s={_b64(salt)},i={iterations}"
    client_final_without_proof = f"c=biws,r={nonce}"
    return f"{client_first_bare},{server_first},{client_final_without_proof}".encode()


def client_proof(salted: bytes, auth: bytes) -> bytes:
    """``ClientKey XOR HMAC(H(ClientKey), AuthMessage)``: what the node sends."""
    key = client_key(salted)
    return _xor(key, _hmac(_h(key), auth))


def server_signature(server_key_: bytes, auth: bytes) -> bytes:
    """``HMAC(ServerKey, AuthMessage)``: what the edge sends back as its own proof."""
    return _hmac(server_key_, auth)


def verify_server_signature(salted: bytes, auth: bytes, signature: bytes) -> bool:
    """The node's check that the edge holds its verifier (constant time)."""
    return hmac.compare_digest(server_signature(server_key(salted), auth), signature)


@dataclass(frozen=True, slots=True, repr=False)
class Verifier:
    """What an edge stores for a node: enough to check a proof, not to make one."""

    salt: bytes
    iterations: int
    stored_key: bytes  # H(ClientKey)
    server_key: bytes  # HMAC(SaltedPassword, "Server Key")

    @classmethod
    def from_salted(cls, salted: bytes, salt: bytes, iterations: int) -> Verifier:
        return cls(salt, iterations, _h(client_key(salted)), server_key(salted))

    @classmethod
    def create(
        cls, secret: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
    ) -> Verifier:
        """A verifier of ``secret`` with a fresh random salt (or the given one)."""
        salt = secrets.token_bytes(SALT_BYTES) if salt is None else salt
        return cls.from_salted(salted_password(secret, salt, iterations), salt, iterations)

    def verify_proof(self, auth: bytes, proof: bytes) -> bool:
        """True when ``proof`` was made with the secret behind this verifier (constant time).

        ``ClientKey = proof XOR HMAC(StoredKey, AuthMessage)``, then
        ``H(ClientKey) == StoredKey``.
        """
        signature = _hmac(self.stored_key, auth)
        if len(proof) != len(signature):
            return False
        return hmac.compare_digest(_h(_xor(proof, signature)), self.stored_key)

    def encode(self) -> str:
        """The single-string form of the config (``VERIFIER_FORMAT``)."""
        return (
            f"{MECHANISM}${self.iterations}:{_b64(self.salt)}"
            f"${_b64(self.stored_key)}:{_b64(self.server_key)}"
        )

    @classmethod
    def parse(cls, text: str) -> Verifier:
        """Read ``VERIFIER_FORMAT``; ``ValueError`` saying what is wrong (never echoing it)."""
        m = _VERIFIER.match(text.strip())
        if m is None:
            raise ValueError(f"must have the form {VERIFIER_FORMAT} (see 'iopd token')")
        iterations = int(m["iterations"])
        if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
            raise ValueError(f"iterations must be {MIN_ITERATIONS}..{MAX_ITERATIONS}")
        try:
            salt, stored, server = (
                base64.b64decode(m[k], validate=True) for k in ("salt", "stored", "server")
            )
        except (binascii.Error, ValueError):
            raise ValueError("is not valid base64 in one of its parts") from None
        if not 1 <= len(salt) <= MAX_SALT_BYTES or len(stored) != 32 or len(server) != 32:
            raise ValueError(f"needs a salt of 1..{MAX_SALT_BYTES} bytes and two 32-byte keys")
        return cls(salt, iterations, stored, server)


__all__ = [
    "DEFAULT_ITERATIONS",
    "MAX_ITERATIONS",
    "MECHANISM",
    "MIN_ITERATIONS",
    "VERIFIER_FORMAT",
    "Verifier",
    "auth_message",
    "client_proof",
    "new_nonce",
    "nonce_problem",
    "salted_password",
    "server_signature",
    "token_sha256",
    "verify_server_signature",
]
