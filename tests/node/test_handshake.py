"""The node handshake (wire protocol 2, SCRAM-SHA-256) between a real ``NodeHub`` and nodes.

What must hold: a recorded handshake replayed is refused; nothing in an
edge's config (the verifier) logs anyone in, at that edge or another; a
failing handshake for a connected node id leaves its session alone; peers of
protocol 1 are refused with a reason both ways; a node trusts only an edge
that proves it holds the node's verifier.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import msgspec
import pytest
import trio

from iopd.config.schema import NodeSection
from iopd.edge.nodes.hub import NodeHub
from iopd.node.edges.handshake import HandshakeFailed, SaltedPasswords, client_handshake
from iopd.node.edges.link import NodeLink
from iopd.transport.channel import WireChannel
from iopd.transport.dial import dial
from iopd.transport.listen import serve_wire
from tests.support import hubs
from tests.support.node_parts import ScriptedHandler
from tests.support.wire_peers import TEST_ITERATIONS, FakeEdge, FakeNode, HubRecorder, wait_until
from wire import scram
from wire.connection import Connection, Role
from wire.framing import encode_frame
from wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    HelloAck,
    Message,
    Proof,
    Refused,
    RunEvent,
    RunRequest,
)

TOKEN = "node-a-token-secret"
TOKENS = {"node-a": TOKEN}


def verifier(token: str = TOKEN) -> str:
    return scram.Verifier.create(token, iterations=TEST_ITERATIONS).encode()


def running_hub(
    verifiers: dict[str, str] | None = None, *, edge_id: str = "edge-1"
) -> AbstractAsyncContextManager[tuple[NodeHub, int, HubRecorder]]:
    """A hub on port 0; ``verifiers``: nodes holding the strong form (else the hash)."""
    return hubs.running_hub(HubRecorder(TOKENS, verifiers=dict(verifiers or {})), edge_id=edge_id)


class RawNode:
    """A node speaking through a bare ``Connection``: sends exactly what the test says."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.conn = Connection(Role.NODE)
        self.pending: list[Message] = []

    @classmethod
    @asynccontextmanager
    async def connect(cls, port: int) -> AsyncIterator[RawNode]:
        stream = await dial("127.0.0.1", port, ssl_context=None, connect_timeout=5)
        try:
            yield cls(stream)
        finally:
            await stream.aclose()

    async def send(self, msg: Message) -> None:
        await self.stream.send_all(self.conn.send(msg))

    async def recv(self) -> Message:
        while not self.pending:
            data = await self.stream.receive_some(65536)
            assert data, "edge closed the connection"
            self.pending += self.conn.receive_data(data)
        return self.pending.pop(0)


def hello(nonce: str, node_id: str = "node-a") -> Hello:
    return Hello(protocol_version=PROTOCOL_VERSION, node_id=node_id, token="", nonce=nonce)


def proof_for(secret: str, node_id: str, nonce: str, challenge: Challenge) -> Proof:
    salted = scram.salted_password(secret, challenge.salt, challenge.iterations)
    auth = scram.auth_message(node_id, nonce, challenge.nonce, challenge.salt, challenge.iterations)
    return Proof(proof=scram.client_proof(salted, auth))


async def record_handshake(port: int, form_secret: str) -> tuple[Hello, Proof, Message]:
    """An honest node's handshake as an eavesdropper records it: Hello, Proof, reply."""
    nonce = scram.new_nonce()
    async with RawNode.connect(port) as node:
        await node.send(hello(nonce))
        challenge = await node.recv()
        assert isinstance(challenge, Challenge)
        proof = proof_for(form_secret, "node-a", nonce, challenge)
        await node.send(proof)
        return hello(nonce), proof, await node.recv()


async def replay_handshake(port: int, recorded_hello: Hello, recorded_proof: Proof) -> Message:
    """Send a recorded Hello, then its recorded Proof whatever the new challenge; the reply."""
    async with RawNode.connect(port) as replay:
        await replay.send(recorded_hello)  # same Hello, same nonce
        assert isinstance(await replay.recv(), Challenge)
        await replay.send(recorded_proof)
        return await replay.recv()


# ------------------------------------------------------------------ replay


@pytest.mark.parametrize("form", ["token_verifier", "token_hash_sha256"])
async def test_a_recorded_handshake_replayed_is_refused(form: str) -> None:
    verifiers = {"node-a": verifier()} if form == "token_verifier" else {}
    secret = TOKEN if form == "token_verifier" else scram.token_sha256(TOKEN)
    with trio.fail_after(10):
        async with running_hub(verifiers) as (hub, port, rec):
            recorded_hello, recorded_proof, reply = await record_handshake(port, secret)
            assert isinstance(reply, HelloAck)  # the honest handshake got through
            await wait_until(lambda: hub.session("node-a") is None)  # it hung up
            refused = await replay_handshake(port, recorded_hello, recorded_proof)
            assert isinstance(refused, Refused) and refused.code == "bad_token"
            assert hub.session("node-a") is None
            assert rec.events.count(("connect", "node-a")) <= 1


async def test_a_handshake_recorded_at_one_edge_is_refused_at_another() -> None:
    """Each edge has its own verifier of the same token (its own salt)."""
    with trio.fail_after(10):
        async with (
            running_hub({"node-a": verifier()}, edge_id="edge-1") as (_hub1, port1, _rec1),
            running_hub({"node-a": verifier()}, edge_id="edge-2") as (hub2, port2, rec2),
        ):
            recorded_hello, recorded_proof, reply = await record_handshake(port1, TOKEN)
            assert isinstance(reply, HelloAck)
            refused = await replay_handshake(port2, recorded_hello, recorded_proof)
            assert isinstance(refused, Refused) and refused.code == "bad_token"
            assert hub2.session("node-a") is None and rec2.events == []


# ------------------------------------------------------- the verifier is not a login


def _forgeries(stolen: scram.Verifier, text: str) -> dict[str, str | bytes]:
    """What someone holding an edge's ``token_verifier`` could try as the secret or key."""
    return {
        "verifier string as token": text,
        "StoredKey as salted password": stolen.stored_key,
        "ServerKey as salted password": stolen.server_key,
        "StoredKey hex as token": stolen.stored_key.hex(),
    }


@pytest.mark.parametrize("same_edge", [True, False], ids=["same-edge", "other-edge"])
async def test_a_verifier_from_an_edge_config_cannot_log_in(same_edge: bool) -> None:
    stolen_text = verifier()
    stolen = scram.Verifier.parse(stolen_text)
    target = {"node-a": stolen_text if same_edge else verifier()}
    with trio.fail_after(20):
        async with running_hub(target) as (hub, port, rec):
            for attempt, key in _forgeries(stolen, stolen_text).items():
                nonce = scram.new_nonce()
                async with RawNode.connect(port) as node:
                    await node.send(hello(nonce))
                    challenge = await node.recv()
                    assert isinstance(challenge, Challenge)
                    auth = scram.auth_message(
                        "node-a", nonce, challenge.nonce, challenge.salt, challenge.iterations
                    )
                    if isinstance(key, bytes):
                        proof = Proof(proof=scram.client_proof(key, auth))
                    else:
                        proof = proof_for(key, "node-a", nonce, challenge)
                    await node.send(proof)
                    reply = await node.recv()
                assert isinstance(reply, Refused) and reply.code == "bad_token", attempt
            assert hub.session("node-a") is None and rec.events == []


# ------------------------------------------- replacement only after authentication


async def test_a_failing_handshake_leaves_the_connected_session_untouched() -> None:
    def script(req: RunRequest | object) -> list[RunEvent]:
        assert isinstance(req, RunRequest)
        return [RunEvent(stream_id=req.stream_id, kind="complete", text="still here")]

    with trio.fail_after(10):
        async with running_hub({"node-a": verifier()}) as (hub, port, rec):
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKEN, responder=script
            ):
                await wait_until(lambda: hub.session("node-a") is not None)
                session = hub.session("node-a")
                # 1. a wrong proof, 2. a Hello that never sends its proof,
                # 3. a Hello with an unusable nonce
                async with FakeNode.connect(
                    "127.0.0.1", port, node_id="node-a", token="not-the-token"
                ) as impostor:
                    assert isinstance(impostor.hello_reply, Refused)
                async with RawNode.connect(port) as silent:
                    await silent.send(hello(scram.new_nonce()))
                    assert isinstance(await silent.recv(), Challenge)
                async with RawNode.connect(port) as bad:
                    await bad.send(hello("short"))
                    refused = await bad.recv()
                    assert isinstance(refused, Refused) and refused.code == "bad_handshake"
                await trio.testing.wait_all_tasks_blocked()
                assert hub.session("node-a") is session
                assert rec.events == [("connect", "node-a")]
                async with session.open_stream(
                    RunRequest(stream_id=0, provider_id="p", adapter="echo", target="m")
                ) as replies:
                    assert [m.text async for m in replies] == ["still here"]


# ------------------------------------------------------------------ versions


class HelloV1(msgspec.Struct, tag="Hello", tag_field="t", kw_only=True):
    """``Hello`` as protocol 1 defined it (the token itself inside)."""

    protocol_version: int
    node_id: str
    token: str
    software_version: str = ""


async def test_a_protocol_1_node_is_refused_with_a_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "iopd.edge.nodes")
    old = HelloV1(protocol_version=1, node_id="node-a", token=TOKEN, software_version="0.9")
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            async with RawNode.connect(port) as node:
                await node.stream.send_all(encode_frame(old))  # type: ignore[arg-type]
                node.conn.send(hello(scram.new_nonce()))  # our side of the table moves too
                refused = await node.recv()
            assert hub.session("node-a") is None
    assert isinstance(refused, Refused) and refused.code == "version_mismatch"
    assert "protocol 1" in refused.reason and f"speaks {PROTOCOL_VERSION}" in refused.reason
    assert "code=version_mismatch" in caplog.text and TOKEN not in caplog.text


def test_a_protocol_1_edge_can_decode_our_hello_and_refuse_it_by_version() -> None:
    """Protocol 1 edges checked the version first; our Hello must decode for them."""
    frame = encode_frame(hello(scram.new_nonce()))
    old = msgspec.msgpack.decode(frame[4:], type=HelloV1)
    assert old.protocol_version == PROTOCOL_VERSION and old.token == ""


async def test_a_node_logs_one_clear_line_when_refused_for_its_version(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iopd.node.link")
    refusal = Refused(
        reason="protocol version 2 not supported (edge speaks 1)", code="version_mismatch"
    )
    cfg = NodeSection(
        id="node-a",
        edge="edge:7070",
        token=TOKEN,
        reconnect_initial_backoff=0.5,
        reconnect_max_backoff=8.0,
    )
    with trio.fail_after(1000):
        async with FakeEdge.in_memory(token=TOKEN, refuse=refusal) as edge:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("iopd.node.edges.link.dial", edge.dial)
                link = NodeLink(cfg, ScriptedHandler(), software_version="1", rng=lambda: 1.0)
                async with trio.open_nursery() as nursery:
                    await nursery.start(link.run)
                    await wait_until(lambda: len(edge.hellos) >= 2, poll=0.1, timeout=500)
                    nursery.cancel_scope.cancel()
    lines = [r for r in caplog.records if "node_refused_by_edge" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.ERROR for r in lines)  # one per try
    assert "run the same iopd release" in lines[0].getMessage()
    gaps = [b - a for a, b in zip(edge.dial_times, edge.dial_times[1:], strict=False)]
    assert gaps[0] == pytest.approx(8.0)  # retrying fast cannot help


# ------------------------------------------------------ the node checks the edge


@asynccontextmanager
async def serving_edge(handler: Callable[[trio.abc.Stream], Awaitable[None]]) -> AsyncIterator[int]:
    """``handler`` serving wire connections on a port 0 listener; yields the port."""
    async with trio.open_nursery() as nursery:
        _host, port = await nursery.start(serve_wire, handler, "127.0.0.1", 0)
        yield port
        nursery.cancel_scope.cancel()


async def handshake_as_node_a(port: int) -> HelloAck:
    """The real node side of the handshake, as ``node-a``, on a new connection to ``port``."""
    stream = await dial("127.0.0.1", port, ssl_context=None, connect_timeout=5)
    channel = WireChannel(stream, Connection(Role.NODE), name="n")
    try:
        return await client_handshake(
            channel,
            node_id="node-a",
            token=TOKEN,
            software_version="1",
            timeout=5,
            salted=SaltedPasswords(),
        )
    finally:
        await channel.aclose()


async def _impostor_edge(stream: trio.abc.Stream) -> None:
    """Acks any proof with a signature it cannot have made (it lacks the verifier)."""
    channel = WireChannel(stream, Connection(Role.EDGE), name="impostor")
    first = await channel.receive_message()
    assert isinstance(first, Hello)
    nonce = first.nonce + scram.new_nonce()
    await channel.send(Challenge(nonce=nonce, salt=b"salt", iterations=TEST_ITERATIONS))
    assert isinstance(await channel.receive_message(), Proof)
    await channel.send(HelloAck(edge_id="impostor", server_signature=bytes(32)))
    await trio.sleep_forever()


async def test_a_node_does_not_trust_an_edge_that_cannot_sign() -> None:
    with trio.fail_after(10):
        async with serving_edge(_impostor_edge) as port:
            with pytest.raises(HandshakeFailed) as info:
                await handshake_as_node_a(port)
    assert info.value.event == "edge_not_trusted" and info.value.slow
    assert TOKEN not in info.value.reason


async def test_a_node_refuses_a_challenge_with_absurd_iterations() -> None:
    async def greedy_edge(stream: trio.abc.Stream) -> None:
        channel = WireChannel(stream, Connection(Role.EDGE), name="greedy")
        first = await channel.receive_message()
        assert isinstance(first, Hello)
        nonce = first.nonce + scram.new_nonce()
        await channel.send(Challenge(nonce=nonce, salt=b"s", iterations=10**9))
        await trio.sleep_forever()

    with trio.fail_after(10):
        async with serving_edge(greedy_edge) as port:
            with pytest.raises(HandshakeFailed) as info:
                await handshake_as_node_a(port)
    assert info.value.event == "edge_bad_challenge" and "iterations" in info.value.reason


async def test_verifier_form_end_to_end_with_the_real_node_handshake() -> None:
    with trio.fail_after(10):
        async with running_hub({"node-a": verifier()}) as (_hub, port, _rec):
            ack = await handshake_as_node_a(port)
    assert ack.edge_id == "edge-1" and len(ack.server_signature) == 32
