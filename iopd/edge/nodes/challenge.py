"""The edge's side of the node handshake: a SCRAM-SHA-256 challenge against the node's verifier.

Why: a node's token never crosses the wire (protocol 2).  The node sends its
nonce in ``Hello``; the edge answers ``Challenge`` (both nonces, the
verifier's salt and iterations); the node's ``Proof`` is checked against the
verifier (``wire.scram``), and the edge's own signature goes back in
``HelloAck``.  Fresh nonces on both sides make a recorded handshake useless.

Two forms of what the edge holds for a node (``nodes[]``):

* ``token_verifier`` (strong): salt, iterations, StoredKey, ServerKey.  The
  token cannot be derived from it and nobody can log in with it.
* ``token_hash_sha256`` (weaker, legacy): the node keys its proof with the
  hex SHA-256 of its token instead of the token, and the edge derives a
  verifier from that hash with a salt drawn once per edge process.  The raw
  token still never crosses and a recorded handshake still cannot be
  replayed, but whoever reads the edge's config holds the proof's key and
  can log in as the node.

Everything here is bounded: nothing costly happens before the node id is
known, the one key derivation of the hash form (``MIN_ITERATIONS`` rounds,
about a millisecond) is cached per hash, and the peer's nonce and proof are
checked for size before use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from iopd.config.schema import NodeEntry
from iopd.transport.channel import WireChannel
from wire import scram
from wire.messages import Challenge, Hello, Proof

RefuseCode = Literal["unknown_node", "bad_token", "version_mismatch", "bad_handshake"]
SecretForm = Literal["token", "token_sha256"]

#: Iterations of a verifier derived from a ``token_hash_sha256``: the hash is a
#: 256-bit secret already, more rounds would only cost.
HASH_FORM_ITERATIONS = scram.MIN_ITERATIONS
#: Cached verifiers (parsed or derived); a refresh that changes every node's
#: secret many times over just starts the cache afresh past this.
MAX_CACHED_VERIFIERS = 4096


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the handshake is refused: the ``Refused`` to send."""

    reason: str
    code: RefuseCode


class NodeVerifiers:
    """The verifier each node is challenged with, cached by its config string."""

    def __init__(self) -> None:
        self._cache: dict[tuple[SecretForm, str], scram.Verifier] = {}

    def for_entry(self, entry: NodeEntry) -> tuple[scram.Verifier, SecretForm]:
        """``entry``'s verifier and the secret form its proof is keyed with.

        ``ValueError`` when ``token_verifier`` does not parse (validation
        rejects that at load, so only a config that bypassed it sees this).
        """
        form: SecretForm = "token" if entry.token_verifier else "token_sha256"
        key = entry.token_verifier if form == "token" else entry.token_hash_sha256.lower()
        verifier = self._cache.get((form, key))
        if verifier is None:
            if form == "token":
                verifier = scram.Verifier.parse(key)
            else:
                verifier = scram.Verifier.create(key, iterations=HASH_FORM_ITERATIONS)
            if len(self._cache) >= MAX_CACHED_VERIFIERS:
                self._cache.clear()
            self._cache[(form, key)] = verifier
        return verifier, form


async def challenge_node(
    channel: WireChannel, hello: Hello, verifier: scram.Verifier, form: SecretForm
) -> bytes | Refusal:
    """Challenge the node that sent ``hello``; its server signature for ``HelloAck``,
    or the refusal to send.  The caller bounds the time (the handshake timeout)."""
    problem = scram.nonce_problem(hello.nonce)
    if problem is not None:
        return Refusal(f"bad Hello: {problem}", "bad_handshake")
    nonce = hello.nonce + scram.new_nonce()
    await channel.send(
        Challenge(nonce=nonce, salt=verifier.salt, iterations=verifier.iterations, secret=form)
    )
    msg = await channel.receive_message()
    assert isinstance(msg, Proof)  # the connection table allows nothing else
    auth = scram.auth_message(hello.node_id, hello.nonce, nonce, verifier.salt, verifier.iterations)
    if not verifier.verify_proof(auth, msg.proof):
        what = "token_verifier" if form == "token" else "token_hash_sha256"
        return Refusal(f"node's proof does not match its {what} (wrong node.token?)", "bad_token")
    return scram.server_signature(verifier.server_key, auth)


__all__ = [
    "HASH_FORM_ITERATIONS",
    "NodeVerifiers",
    "RefuseCode",
    "Refusal",
    "SecretForm",
    "challenge_node",
]
