"""Two sans-IO wire connections, edge and node, and the moves between them."""

from __future__ import annotations

from wire.connection import (
    Connection,
    ConnState,
    Role,
)
from wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    HelloAck,
    Message,
    Proof,
    RunEvent,
    RunRequest,
)

HELLO = Hello(protocol_version=PROTOCOL_VERSION, node_id="n1", token="", nonce="c" * 24)


CHALLENGE = Challenge(nonce="c" * 48, salt=b"salt", iterations=4096)


PROOF = Proof(proof=bytes(32))


ACK = HelloAck(edge_id="e1")


def xfer(src: Connection, dst: Connection, msg: Message) -> list[Message]:
    """Send ``msg`` from ``src`` and feed the bytes to ``dst``."""
    return dst.receive_data(src.send(msg))


def pair() -> tuple[Connection, Connection]:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    assert xfer(node, edge, HELLO) == [HELLO]
    assert edge.hello == HELLO
    xfer(edge, node, CHALLENGE)
    assert edge.state is node.state is ConnState.CHALLENGED
    xfer(node, edge, PROOF)
    assert edge.state is node.state is ConnState.PROOF_SENT
    xfer(edge, node, ACK)
    assert edge.state is node.state is ConnState.OPEN
    return edge, node


def run_req(sid: int, window: int = 2) -> RunRequest:
    return RunRequest(stream_id=sid, provider_id="p", adapter="echo", target="m", window=window)


def text(sid: int) -> RunEvent:
    return RunEvent(stream_id=sid, kind="text", text="x")
