"""The wire before authentication: the handshake's frame cap and the listener's pending caps.

Sans-IO for the frame cap (``wire.connection.Connection``), real loopback
sockets for ``serve_wire`` + ``PendingGate`` + ``NodeHub``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iopd.edge.nodes.hub import NodeHub
from iopd.transport.listen import PendingGate, address_key, serve_wire
from tests.support.hubs import make_hub
from tests.support.wire_peers import FakeNode, HubRecorder, wait_until
from wire import scram
from wire.connection import Connection, ConnState, Role
from wire.errors import FrameTooLarge, LocalProtocolError
from wire.framing import (
    HANDSHAKE_MAX_FRAME_BYTES,
    MAX_FRAME_BYTES,
    MAX_HANDSHAKE_ID_CHARS,
    PREFIX_BYTES,
    encode_frame,
)
from wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    HelloAck,
    Message,
    Proof,
    Refused,
    RunRequest,
)

#: The longest id config validation admits, in 4-byte UTF-8 characters: the
#: worst case for a handshake frame's size.
LONGEST_ID = "\U0001f600" * MAX_HANDSHAKE_ID_CHARS


def largest_handshake_messages() -> list[Message]:
    """Every handshake message at the largest size a legal peer sends."""
    return [
        Hello(
            protocol_version=PROTOCOL_VERSION,
            node_id=LONGEST_ID,
            token="",
            software_version="9999.9999.9999.dev9999+g0123456789abcdef",
            nonce="n" * scram.MAX_NONCE_CHARS,
        ),
        Challenge(
            nonce="n" * (2 * scram.MAX_NONCE_CHARS),
            salt=b"s" * scram.MAX_SALT_BYTES,
            iterations=scram.MAX_ITERATIONS,
            secret="token_sha256",
        ),
        Proof(proof=b"p" * 32),  # an HMAC-SHA-256
        HelloAck(
            edge_id=LONGEST_ID,
            heartbeat_interval=1e9,
            heartbeat_timeout=1e9,
            session_id="s" * 128,
            server_signature=b"g" * 32,
        ),
        # Longer than any reason the edge gives (they name a version or a key).
        Refused(reason="r" * 400, code="version_mismatch"),
    ]


def test_handshake_frames_fit_the_handshake_cap_with_room() -> None:
    sizes = {
        type(m).__name__: len(encode_frame(m)) - PREFIX_BYTES for m in largest_handshake_messages()
    }
    # The largest legal frame (an id of 1024 four-byte characters) is about
    # 4 KiB; everything else is under 1 KiB.
    assert max(sizes.values()) < HANDSHAKE_MAX_FRAME_BYTES * 0.6, sizes
    assert sizes["Proof"] < 64 and sizes["Challenge"] < 512, sizes


def handshake_pair() -> tuple[Connection, Connection]:
    """An edge and a node ``Connection`` with the session cap of the default config."""
    return Connection(Role.EDGE), Connection(Role.NODE)


def test_a_session_sized_prefix_before_hello_is_refused_before_buffering() -> None:
    edge, _node = handshake_pair()
    junk = (MAX_FRAME_BYTES - 1).to_bytes(PREFIX_BYTES, "big") + b"x" * 60_000
    with pytest.raises(FrameTooLarge, match=f"{HANDSHAKE_MAX_FRAME_BYTES}-byte limit"):
        edge.receive_data(junk)
    assert edge._decoder.buffered == 0
    assert edge.state is ConnState.CLOSED


def test_the_handshake_cap_is_inclusive() -> None:
    edge, _node = handshake_pair()
    edge.receive_data(HANDSHAKE_MAX_FRAME_BYTES.to_bytes(PREFIX_BYTES, "big") + b"x" * 100)
    assert edge._decoder.buffered == PREFIX_BYTES + 100  # waiting for the rest
    edge2, _ = handshake_pair()
    with pytest.raises(FrameTooLarge):
        edge2.receive_data((HANDSHAKE_MAX_FRAME_BYTES + 1).to_bytes(PREFIX_BYTES, "big"))


def test_our_handshake_frames_are_held_to_the_cap_too() -> None:
    edge, node = handshake_pair()
    hello = Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="", nonce="a" * 24)
    edge.receive_data(node.send(hello))
    with pytest.raises(LocalProtocolError, match="frame limit"):
        edge.send(Refused(reason="r" * (HANDSHAKE_MAX_FRAME_BYTES + 1)))
    assert edge.state is ConnState.HELLO_SENT  # nothing was sent


def big_run(stream_id: int) -> RunRequest:
    """A session frame far over the handshake cap."""
    text = "x" * (4 * HANDSHAKE_MAX_FRAME_BYTES)
    return RunRequest(
        stream_id=stream_id,
        provider_id="p",
        adapter="echo",
        target="m",
        messages=[{"role": "user", "content": text}],
    )


def open_session(edge: Connection, node: Connection) -> bytes:
    """Run the handshake up to the edge's ``HelloAck``; return its frame (not yet delivered)."""
    hello = Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="", nonce="a" * 24)
    edge.receive_data(node.send(hello))
    challenge = Challenge(nonce="a" * 48, salt=b"s" * 16, iterations=scram.MIN_ITERATIONS)
    node.receive_data(edge.send(challenge))
    edge.receive_data(node.send(Proof(proof=b"p" * 32)))
    return edge.send(HelloAck(edge_id="e"))


def test_the_session_cap_applies_from_the_frame_after_helloack_in_the_same_read() -> None:
    edge, node = handshake_pair()
    ack = open_session(edge, node)
    msgs = node.receive_data(ack + edge.send(big_run(1)) + edge.send(big_run(2)))
    assert [type(m) for m in msgs] == [HelloAck, RunRequest, RunRequest]
    assert node.state is ConnState.OPEN and node.frame_limit == MAX_FRAME_BYTES
    assert node.last_stream_id == 2


def test_the_edge_takes_session_frames_once_it_sent_helloack() -> None:
    edge, node = handshake_pair()
    node.receive_data(open_session(edge, node))
    assert edge.frame_limit == MAX_FRAME_BYTES
    huge = b"\x00" * (2 * HANDSHAKE_MAX_FRAME_BYTES)
    prefix = len(huge).to_bytes(PREFIX_BYTES, "big")
    # Not a legal message (the decode fails), but its length is accepted.
    edge.receive_data(prefix + huge[:100])
    assert edge._decoder.buffered == PREFIX_BYTES + 100


# ------------------------------------------------------------------ PendingGate


def test_address_keys() -> None:
    assert address_key("192.0.2.7") == "192.0.2.7"
    assert address_key("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("not-an-ip") == "not-an-ip"


def _S() -> trio.abc.Stream:  # noqa: N802 - reads as a constructor
    """A distinct stream object (the gate keys by identity)."""
    return trio.testing.memory_stream_pair()[0]


async def test_gate_counts_caps_and_releases(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "iopd.transport")
    refused: list[str] = []
    gate = PendingGate(3, 2, on_refused=refused.append)
    a1, a2, a3, b1, b2 = (_S() for _ in range(5))
    assert gate.enter(a1, "a") is None and gate.enter(a2, "a") is None
    assert gate.enter(a3, "a") == "max_pending_per_address"
    assert gate.enter(b1, "b") is None
    assert gate.enter(b2, "b") == "max_pending"
    assert (gate.pending, gate.pending_for("a"), gate.pending_for("b")) == (3, 2, 1)
    gate.release(a1)
    gate.release(a1)  # idempotent
    gate.release(_S())  # never admitted: ignored
    assert (gate.pending, gate.pending_for("a")) == (2, 1)
    assert gate.enter(a3, "a") is None
    for s in (a2, a3, b1):
        gate.release(s)
    assert gate.pending == 0 and gate._by_key == {}
    assert refused == ["max_pending_per_address", "max_pending"]
    assert gate.refused_total == 2
    # One log line for both refusals (they came within the log interval).
    lines = [r for r in caplog.records if "wire_connection_refused" in r.getMessage()]
    assert len(lines) == 1


def test_gate_rejects_nonsense_caps() -> None:
    with pytest.raises(ValueError):
        PendingGate(0, 1)
    with pytest.raises(ValueError):
        PendingGate(1, 0)


# ------------------------------------------------------------------ serve_wire


TOKENS = {"node-a": "token-a-secret", LONGEST_ID: "token-long-secret"}


@asynccontextmanager
async def gated_hub(
    *, max_pending: int, per_address: int, handshake_timeout: float = 10.0
) -> AsyncIterator[tuple[NodeHub, PendingGate, int, HubRecorder]]:
    rec = HubRecorder(TOKENS)
    hub = make_hub(
        rec,
        edge_id=LONGEST_ID,
        handshake_timeout=handshake_timeout,
        max_pending=max_pending,
        max_pending_per_address=per_address,
    )
    gate = hub.listener_gate()
    async with trio.open_nursery() as nursery:
        handler = lambda s: hub.handle_connection(s, gate=gate)  # noqa: E731
        _h, port = await nursery.start(
            lambda task_status: serve_wire(
                handler, "127.0.0.1", 0, gate=gate, task_status=task_status
            )
        )
        yield hub, gate, port, rec
        await hub.aclose("test over")
        nursery.cancel_scope.cancel()


async def raw_connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def refused(port: int) -> bool:
    """A new connection is closed by the edge at once (it may see the reset
    before its own connect returned)."""
    try:
        stream = await raw_connect(port)
    except OSError:
        return True
    async with stream:
        return await closed_by_peer(stream)


async def closed_by_peer(stream: trio.SocketStream) -> bool:
    """True when the edge closed ``stream`` without sending anything."""
    try:
        return await stream.receive_some(100) == b""
    except trio.BrokenResourceError:  # the reset
        return True


async def test_connections_past_the_caps_are_closed_at_once_and_nodes_still_get_in() -> None:
    with trio.fail_after(20):
        async with gated_hub(max_pending=3, per_address=2) as (hub, gate, port, rec):
            idle = [await raw_connect(port), await raw_connect(port)]
            await wait_until(lambda: gate.pending == 2)
            assert await refused(port)
            assert gate.refused_total == 1 and rec.errors == ["pending_limit"]
            await idle.pop().aclose()
            await wait_until(lambda: gate.pending == 1)
            # A node takes the free slot, authenticates, and leaves the count:
            # the slot is free again for another connection while it stays.
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"]
            ) as node:
                assert isinstance(node.hello_reply, HelloAck)
                await wait_until(lambda: hub.session("node-a") is not None)
                assert gate.pending == 1
                idle.append(await raw_connect(port))
                await wait_until(lambda: gate.pending == 2)
                assert await refused(port)
                assert hub.session("node-a") is not None
            for s in idle:
                await s.aclose()
            await wait_until(lambda: gate.pending == 0)
            assert rec.errors == ["pending_limit", "pending_limit"]


async def test_a_slot_is_freed_by_the_handshake_deadline() -> None:
    with trio.fail_after(20):
        async with gated_hub(max_pending=1, per_address=1, handshake_timeout=0.2) as (
            _hub,
            gate,
            port,
            rec,
        ):
            silent = await raw_connect(port)
            await wait_until(lambda: gate.pending == 1)
            assert await closed_by_peer(silent)  # the deadline closed it
            await wait_until(lambda: gate.pending == 0)
            assert "handshake" in rec.errors


async def test_an_oversized_prefix_is_refused_without_waiting_for_its_bytes() -> None:
    with trio.fail_after(20):
        async with gated_hub(max_pending=4, per_address=4) as (_hub, gate, port, rec):
            s = await raw_connect(port)
            await s.send_all((MAX_FRAME_BYTES - 1).to_bytes(PREFIX_BYTES, "big") + b"x" * 1000)
            assert await closed_by_peer(s)
            await wait_until(lambda: "frame_too_large" in rec.errors)
            await wait_until(lambda: gate.pending == 0)


async def test_the_longest_ids_complete_a_real_handshake() -> None:
    with trio.fail_after(20):
        async with gated_hub(max_pending=4, per_address=4) as (hub, gate, port, _rec):
            async with FakeNode.connect(
                "127.0.0.1", port, node_id=LONGEST_ID, token=TOKENS[LONGEST_ID]
            ) as node:
                assert isinstance(node.hello_reply, HelloAck)
                assert node.hello_reply.edge_id == LONGEST_ID
                await wait_until(lambda: hub.session(LONGEST_ID) is not None)
                assert gate.pending == 0
