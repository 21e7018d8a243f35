"""The node's side of the handshake: prove the token (SCRAM-SHA-256), check the edge's proof.

Why: the token never crosses the wire (protocol 2).  The node sends
``Hello`` with a fresh nonce, answers the edge's ``Challenge`` with a
``Proof`` over both nonces, and accepts ``HelloAck`` only when its server
signature shows that the edge holds the node's verifier (``wire.scram``).
A ``Challenge`` the node cannot trust (a nonce that is not its own followed
by the edge's, an iteration count out of bounds, an oversized salt) ends the
attempt before any work.

The key derivation (``Hi``: PBKDF2, tens of milliseconds at the default
iterations) runs once per edge verifier: ``SaltedPasswords`` keeps the
result per (secret form, salt, iterations), so a reconnect costs only HMACs.
Above ``MIN_ITERATIONS`` it runs in a worker thread, so the node's sessions
with other edges keep serving meanwhile.

The legacy proof: an edge that holds only ``token_hash_sha256`` asks for a
proof keyed by ``sha256(token)``.  That hash, wherever it lies (an old edge
config, a backup, git history), then passes as the edge: it derives the
server signature.  So the node refuses such a ``Challenge`` before deriving
anything, unless ``node.accept_legacy_proof`` allows it for a migration.
"""

from __future__ import annotations

from collections import OrderedDict

import trio

from iopd.transport.channel import WireChannel
from wire import scram
from wire.messages import (
    FEATURE_GO_AWAY,
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    HelloAck,
    Message,
    Proof,
    Refused,
)

#: The log line's reason for a refused legacy proof: how to get off it.
LEGACY_PROOF_REFUSED = (
    "the edge asked for the legacy proof keyed by sha256(token) (it holds only "
    "nodes[].token_hash_sha256), which anyone holding that old hash could ask for "
    "too; give the edge nodes[].token_verifier (`iopd token --token-env NAME` with "
    "this node's token in $NAME prints it) and drop token_hash_sha256, or set node.accept_legacy_proof: true "
    "on this node while the migration lasts"
)

#: Derived keys kept (an edge's verifier is one entry; a hostile edge that
#: sends a new salt each time only cycles this bounded cache).
MAX_SALTED = 64


class HandshakeFailed(Exception):
    """The handshake did not open a session.

    ``event``: the log event; ``reason``: a sentence safe to log (never the
    token); ``refused``: the edge's ``Refused`` when it sent one; ``slow``:
    retrying fast cannot help (retry near the backoff cap).
    """

    def __init__(
        self, event: str, reason: str, *, refused: Refused | None = None, slow: bool = False
    ) -> None:
        super().__init__(reason)
        self.event = event
        self.reason = reason
        self.refused = refused
        self.slow = slow


class SaltedPasswords:
    """``Hi(secret, salt, iterations)`` per edge verifier, computed once (see the module doc)."""

    def __init__(self) -> None:
        self._cache: OrderedDict[tuple[str, bytes, int], bytes] = OrderedDict()

    async def get(self, secret: str, form: str, salt: bytes, iterations: int) -> bytes:
        key = (form, salt, iterations)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        if iterations <= scram.MIN_ITERATIONS:  # about a millisecond: not worth a thread
            salted = scram.salted_password(secret, salt, iterations)
        else:
            salted = await trio.to_thread.run_sync(scram.salted_password, secret, salt, iterations)
        self._cache[key] = salted
        while len(self._cache) > MAX_SALTED:
            self._cache.popitem(last=False)
        return salted


def challenge_problem(challenge: Challenge, client_nonce: str) -> str | None:
    """Why the node will not answer ``challenge``, or None."""
    if not challenge.nonce.startswith(client_nonce) or len(challenge.nonce) == len(client_nonce):
        return "its nonce does not extend the node's"
    problem = scram.nonce_problem(challenge.nonce[len(client_nonce) :])
    if problem is not None:
        return f"its nonce: {problem}"
    if not scram.MIN_ITERATIONS <= challenge.iterations <= scram.MAX_ITERATIONS:
        return f"iterations must be {scram.MIN_ITERATIONS}..{scram.MAX_ITERATIONS}"
    if not 1 <= len(challenge.salt) <= scram.MAX_SALT_BYTES:
        return f"salt must be 1..{scram.MAX_SALT_BYTES} bytes"
    return None


async def _receive(channel: WireChannel, timeout: float, after: str) -> Message:
    with trio.move_on_after(timeout):
        return await channel.receive_message()
    raise HandshakeFailed(
        "edge_handshake_timeout", f"edge did not answer {after} within {timeout:g}s"
    )


async def client_handshake(
    channel: WireChannel,
    *,
    node_id: str,
    token: str,
    software_version: str,
    timeout: float,
    salted: SaltedPasswords,
    accept_legacy_proof: bool = False,
) -> HelloAck:
    """Run the node's handshake on ``channel``; the edge's ``HelloAck`` once it is trusted.

    Raises ``HandshakeFailed``; ``ChannelClosed`` when the link breaks.
    ``timeout`` bounds each wait for the edge.  ``accept_legacy_proof``:
    answer a ``Challenge`` keyed by ``sha256(token)`` (``node.accept_legacy_proof``).
    """
    client_nonce = scram.new_nonce()
    await channel.send(
        Hello(
            protocol_version=PROTOCOL_VERSION,
            node_id=node_id,
            token="",
            software_version=software_version,
            nonce=client_nonce,
            features=[FEATURE_GO_AWAY],
        )
    )
    reply = await _receive(channel, timeout, "Hello")
    if isinstance(reply, Refused):
        raise HandshakeFailed("node_refused_by_edge", reply.reason, refused=reply)
    assert isinstance(reply, Challenge)  # the connection table allows nothing else
    problem = challenge_problem(reply, client_nonce)
    if problem is not None:
        raise HandshakeFailed(
            "edge_bad_challenge", f"edge sent a bad Challenge: {problem}", slow=True
        )
    if reply.secret == "token_sha256" and not accept_legacy_proof:
        raise HandshakeFailed("edge_legacy_proof_refused", LEGACY_PROOF_REFUSED, slow=True)
    secret = token if reply.secret == "token" else scram.token_sha256(token)
    key = await salted.get(secret, reply.secret, reply.salt, reply.iterations)
    auth = scram.auth_message(node_id, client_nonce, reply.nonce, reply.salt, reply.iterations)
    await channel.send(Proof(proof=scram.client_proof(key, auth)))
    reply = await _receive(channel, timeout, "Proof")
    if isinstance(reply, Refused):
        raise HandshakeFailed("node_refused_by_edge", reply.reason, refused=reply)
    assert isinstance(reply, HelloAck)  # the connection table allows nothing else
    if not scram.verify_server_signature(key, auth, reply.server_signature):
        raise HandshakeFailed(
            "edge_not_trusted",
            "the edge's signature does not match this node's token: it does not hold the "
            "node's verifier (a wrong address, or an impostor)",
            slow=True,
        )
    return reply


__all__ = [
    "LEGACY_PROOF_REFUSED",
    "HandshakeFailed",
    "SaltedPasswords",
    "challenge_problem",
    "client_handshake",
]
