"""NodeHub: handshake, refusals, bad input, replacement, streams, credit, heartbeats.

Real sockets on port 0 (through ``FakeNode``) for the integration paths; an
in-memory stream pair + ``autojump_clock`` for everything timed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing

from iopd.edge.nodes.hub import NodeHub
from iopd.edge.nodes.node_session import NodeStream
from iopd.errors import NodeDispatchError
from iopd.transport.listen import serve_wire
from tests.support.hubs import TOKENS, make_hub, node_with_session, run_req, running_hub
from tests.support.wire_peers import FakeNode, HubRecorder, wait_until
from wire import scram
from wire.connection import Connection, Role
from wire.framing import encode_frame
from wire.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Challenge,
    Credit,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    NodeConfig,
    NodeConfigAck,
    Proof,
    ProviderHealth,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
    RunRequest,
)

# ------------------------------------------------------------------ handshake


async def test_connect_pushes_config_then_announces() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"]
            ) as node:
                assert isinstance(node.hello_reply, HelloAck)
                assert node.hello_reply.edge_id == "edge-1"
                await wait_until(lambda: hub.session("node-a") is not None)
                assert node.config is not None and node.config.version == 7
                assert node.config.stream_id >= 1  # assigned by the hub
                assert rec.events == [("connect", "node-a")]
                since = hub.connected_since("node-a")
                assert since is not None and since > 1e9  # wall clock epoch
                assert hub.connected_node_ids() == ["node-a"]
            await wait_until(lambda: rec.events[-1] == ("disconnect", "node-a"))
            assert hub.session("node-a") is None and hub.connected_since("node-a") is None


@pytest.mark.parametrize(
    ("node_id", "token", "version", "code"),
    [
        ("node-x", "whatever", PROTOCOL_VERSION, "unknown_node"),
        ("node-a", "wrong-token", PROTOCOL_VERSION, "bad_token"),
        ("node-a", TOKENS["node-a"], PROTOCOL_VERSION + 1, "version_mismatch"),
    ],
)
async def test_refusals(
    node_id: str, token: str, version: int, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iopd.edge.nodes")
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            async with FakeNode.connect(
                "127.0.0.1", port, node_id=node_id, token=token, protocol_version=version
            ) as node:
                assert isinstance(node.hello_reply, Refused)
                assert node.hello_reply.code == code
            assert hub.session(node_id) is None
            assert rec.events == []
    text = caplog.text
    assert f"code={code}" in text
    assert token not in text and TOKENS["node-a"] not in text


async def test_handshake_timeout_closes_only_that_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = HubRecorder(TOKENS)
    hub = make_hub(rec, handshake_timeout=3.0)
    silent_client, silent_server = trio.testing.memory_stream_pair()
    good_client, good_server = trio.testing.memory_stream_pair()
    good = RawNode(good_client)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.handle_connection, good_server)
            await good.handshake()
            await wait_until(lambda: hub.session("node-a") is not None)
            start = trio.current_time()
            await hub.handle_connection(silent_server)  # returns on its own
            assert trio.current_time() - start == pytest.approx(3.0)
            assert await silent_client.receive_some(100) == b""  # closed
            assert rec.protocol_errors == ["handshake_timeout"]
            assert hub.session("node-a") is not None  # the other node is unaffected
            nursery.cancel_scope.cancel()


async def test_concurrent_opens_get_increasing_ids() -> None:
    def script(req: RunRequest | ProviderTunnelRequest) -> list[RunEvent]:
        return [RunEvent(stream_id=req.stream_id, kind="complete", text=str(req.stream_id))]

    results: list[str] = []
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            async with node_with_session(hub, port, responder=script) as (_node, session):

                async def one() -> None:
                    async with session.open_stream(run_req()) as replies:
                        results.extend([m.text async for m in replies])  # type: ignore[union-attr]

                async with trio.open_nursery() as nursery:
                    for _ in range(40):
                        nursery.start_soon(one)
    assert len(results) == 40 and len(set(results)) == 40


# ------------------------------------------------------------ raw peer helper


class RawNode:
    """A node driven by hand over an in-memory stream (for timed tests)."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.conn = Connection(Role.NODE)
        self.pending: list[Message] = []

    async def send(self, msg: Message) -> None:
        await self.stream.send_all(self.conn.send(msg))

    async def recv(self) -> Message | None:
        while not self.pending:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.pending += self.conn.receive_data(data)
        return self.pending.pop(0)

    async def handshake(self, node_id: str = "node-a") -> NodeConfig:
        client_nonce = scram.new_nonce()
        await self.send(
            Hello(protocol_version=PROTOCOL_VERSION, node_id=node_id, token="", nonce=client_nonce)
        )
        challenge = await self.recv()
        assert isinstance(challenge, Challenge)
        secret = scram.token_sha256(TOKENS[node_id])
        salted = scram.salted_password(secret, challenge.salt, challenge.iterations)
        auth = scram.auth_message(
            node_id, client_nonce, challenge.nonce, challenge.salt, challenge.iterations
        )
        await self.send(Proof(proof=scram.client_proof(salted, auth)))
        assert isinstance(await self.recv(), HelloAck)
        cfg = await self.recv()
        assert isinstance(cfg, NodeConfig)
        await self.send(NodeConfigAck(stream_id=cfg.stream_id, version=cfg.version))
        return cfg


@asynccontextmanager
async def raw_node_on(hub: NodeHub) -> AsyncIterator[tuple[RawNode, trio.Nursery]]:
    """A ``RawNode`` over an in-memory stream that ``hub`` serves, past its handshake."""
    client, server = trio.testing.memory_stream_pair()
    raw = RawNode(client)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.handle_connection, server)
        await raw.handshake()
        yield raw, nursery


async def test_heartbeat_timeout_detects_silent_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rec = HubRecorder(TOKENS)
    hub = make_hub(rec, heartbeat_interval=5.0, heartbeat_timeout=15.0)
    with trio.fail_after(100):
        async with raw_node_on(hub):
            await wait_until(lambda: ("connect", "node-a") in rec.events)
            connected_at = trio.current_time()
            # The node stays silent (reads nothing, sends nothing) from here on.
            await wait_until(lambda: ("disconnect", "node-a") in rec.events, poll=0.5, timeout=100)
            assert trio.current_time() - connected_at == pytest.approx(15.0, abs=0.01)
    assert hub.session("node-a") is None


async def test_heartbeats_keep_a_live_node(autojump_clock: trio.testing.MockClock) -> None:
    rec = HubRecorder(TOKENS)
    hub = make_hub(rec, heartbeat_interval=5.0, heartbeat_timeout=15.0)
    with trio.fail_after(1000):
        async with raw_node_on(hub) as (raw, nursery):
            seen = 0
            while seen < 10:  # 50 virtual seconds, answering every heartbeat
                msg = await raw.recv()
                assert isinstance(msg, Heartbeat)
                from wire.messages import Pong

                await raw.send(Pong(seq=msg.seq))
                seen += 1
            assert hub.session("node-a") is not None
            assert rec.events == [("connect", "node-a")]
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ bad input


def _bad_inputs() -> dict[str, bytes]:
    hello = encode_frame(Hello(protocol_version=PROTOCOL_VERSION, node_id="node-b", token="x"))
    cancel = bytearray(msgspec.msgpack.encode(Cancel(stream_id=1, reason="ab")))
    i = cancel.index(b"ab")
    cancel[i : i + 2] = b"\xff\xfe"
    bogus = msgspec.msgpack.encode({"t": "Bogus"})
    return {
        "oversized": (2**31).to_bytes(4, "big"),
        "garbage": b"\x00\x00\x00\x06\xc1\xc1\xc1\xc1\xc1\xc1",
        "truncated": hello[:-3],  # then EOF
        "bad_utf8": len(cancel).to_bytes(4, "big") + bytes(cancel),
        "unknown_tag": len(bogus).to_bytes(4, "big") + bogus,
        "before_handshake": encode_frame(Heartbeat()),
        "zero_length": b"\x00\x00\x00\x00",
    }


@pytest.mark.parametrize("case", sorted(_bad_inputs()))
async def test_bad_input_closes_only_that_connection(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "iopd.edge.nodes")
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"]
            ) as good:
                await wait_until(lambda: hub.session("node-a") is not None)
                bad = await trio.open_tcp_stream("127.0.0.1", port)
                await bad.send_all(_bad_inputs()[case])
                if case == "truncated":
                    await bad.send_eof()
                # the hub closes the bad connection
                while await bad.receive_some(1000):
                    pass
                await bad.aclose()
                await wait_until(lambda: len(rec.protocol_errors) == 1)
                # the good node is unaffected and still serves
                async with hub.session("node-a").open_stream(run_req()) as replies:  # type: ignore[union-attr]
                    req = await good.receive(RunRequest)
                    await good.send(RunEvent(stream_id=req.stream_id, kind="complete"))
                    assert [m.kind async for m in replies] == ["complete"]  # type: ignore[union-attr]
            assert "event=wire_protocol_error" in caplog.text
            assert rec.events[0] == ("connect", "node-a")


# ------------------------------------------------------------------ sessions


async def test_new_session_replaces_old() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"]
            ) as first:
                await wait_until(lambda: hub.session("node-a") is not None)
                old_session = hub.session("node-a")
                assert old_session is not None
                async with old_session.open_stream(run_req()) as replies:
                    await first.receive(RunRequest)
                    async with FakeNode.connect(
                        "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"]
                    ):
                        with pytest.raises(NodeDispatchError, match="node node-a disconnected"):
                            await replies.__anext__()
                        await wait_until(lambda: rec.events.count(("connect", "node-a")) == 2)
                        new_session = hub.session("node-a")
                        assert new_session is not None and new_session is not old_session
                        assert rec.events == [
                            ("connect", "node-a"),
                            ("disconnect", "node-a"),
                            ("connect", "node-a"),
                        ]
                        assert (await first.wait_closed()) is not None
                with pytest.raises(NodeDispatchError):
                    async with old_session.open_stream(run_req()):
                        pass


async def test_run_stream_round_trip_and_status() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            status = ProviderStatus(providers=[ProviderHealth(provider_id="p1", health="healthy")])
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"], status=status
            ) as node:
                await wait_until(lambda: hub.session("node-a") is not None)
                await wait_until(lambda: rec.statuses == [("node-a", status)])
                session = hub.session("node-a")
                assert session is not None
                async with session.open_stream(run_req()) as replies:
                    req = await node.receive(RunRequest)
                    assert req.provider_id == "echo-1"
                    for word in ("a ", "b"):
                        await node.send(RunEvent(stream_id=req.stream_id, kind="text", text=word))
                    await node.send(RunEvent(stream_id=req.stream_id, kind="complete"))
                    got = [m async for m in replies]
                assert [(m.kind, m.text) for m in got] == [  # type: ignore[union-attr]
                    ("text", "a "),
                    ("text", "b"),
                    ("complete", ""),
                ]
                # no Cancel after a finished stream
                async with session.open_stream(run_req()) as replies:
                    req2 = await node.receive(RunRequest)
                    assert req2.stream_id > req.stream_id
                    await node.send(RunEvent(stream_id=req2.stream_id, kind="complete"))
                    [m async for m in replies]
                await trio.sleep(0.05)
                assert not any(isinstance(m, Cancel) for m in node.received)


async def test_tunnel_stream_scripted_node() -> None:
    def script(req: RunRequest | ProviderTunnelRequest) -> list[ProviderTunnelFrame]:
        sid = req.stream_id
        return [
            ProviderTunnelFrame(stream_id=sid, kind="head", status=200),
            ProviderTunnelFrame(stream_id=sid, kind="body", data=b"{}"),
            ProviderTunnelFrame(stream_id=sid, kind="end"),
        ]

    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"], responder=script
            ):
                await wait_until(lambda: hub.session("node-a") is not None)
                req = ProviderTunnelRequest(
                    stream_id=0, provider_id="p", method="POST", path="/v1/x"
                )
                async with hub.session("node-a").open_stream(req) as replies:  # type: ignore[union-attr]
                    kinds = [m.kind async for m in replies]  # type: ignore[union-attr]
                assert kinds == ["head", "body", "end"]


async def test_node_disconnect_mid_stream_fails_at_once() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req()) as replies:
                    req = await node.receive(RunRequest)
                    await node.send(RunEvent(stream_id=req.stream_id, kind="text", text="x"))
                    await node.send(RunEvent(stream_id=req.stream_id, kind="text", text="y"))
                    await wait_until(lambda: replies.buffered() == 2)  # type: ignore[attr-defined]
                    await node.aclose()
                    with pytest.raises(NodeDispatchError, match="node node-a disconnected"):
                        # frames are still buffered, the error comes first anyway
                        await wait_until(lambda: not session.alive)
                        await replies.__anext__()
                await wait_until(lambda: ("disconnect", "node-a") in rec.events)


async def test_owner_hears_the_disconnect_before_the_streams_fail() -> None:
    """The pool must drop the node before the leases of its failed streams are
    freed (a freed lease re-examines the queue): node_disconnected comes first."""
    open_streams: list[NodeStream[RunEvent]] = []
    failed_when_told: list[bool] = []

    class Owner(HubRecorder):
        def node_disconnected(self, node_id: str) -> None:
            failed_when_told.extend(s.error is not None for s in open_streams)
            super().node_disconnected(node_id)

    rec = Owner(TOKENS)
    hub = make_hub(rec)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            _h, port = await nursery.start(serve_wire, hub.handle_connection, "127.0.0.1", 0)
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req()) as replies:
                    open_streams.append(replies)
                    await node.receive(RunRequest)
                    await node.aclose()
                    with pytest.raises(NodeDispatchError):
                        await replies.__anext__()
            assert failed_when_told == [False]
            assert rec.events == [("connect", "node-a"), ("disconnect", "node-a")]
            await hub.aclose("test over")
            nursery.cancel_scope.cancel()


async def test_leaving_early_sends_cancel_and_late_replies_are_credited() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req(window=4)) as replies:
                    req = await node.receive(RunRequest)
                    await node.send(RunEvent(stream_id=req.stream_id, kind="text", text="1"))
                    await replies.__anext__()
                cancel = await node.receive(Cancel)
                assert cancel.stream_id == req.stream_id
                # a reply racing the cancel: dropped by the hub, credit given back
                await node.send(RunEvent(stream_id=req.stream_id, kind="text", text="late"))
                credit = await node.receive(Credit)
                assert credit.stream_id == req.stream_id
                await node.send(RunEvent(stream_id=req.stream_id, kind="error", code="cancelled"))
                # the session is healthy afterwards
                async with session.open_stream(run_req()) as replies:
                    req2 = await node.receive(RunRequest)
                    await node.send(RunEvent(stream_id=req2.stream_id, kind="complete"))
                    assert len([m async for m in replies]) == 1


async def test_cancelled_consumer_sends_cancel() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            async with node_with_session(hub, port) as (node, session):
                with trio.move_on_after(0.05):  # e.g. the HTTP caller went away
                    async with session.open_stream(run_req()) as replies:
                        await replies.__anext__()
                req = await node.receive(RunRequest)
                cancel = await node.receive(Cancel)
                assert cancel.stream_id == req.stream_id


async def test_credit_returned_as_consumer_reads() -> None:
    window = 8
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req(window=window)) as replies:
                    req = await node.receive(RunRequest)
                    sid = req.stream_id
                    for i in range(window):
                        await node.send(RunEvent(stream_id=sid, kind="text", text=str(i)))
                    # window exhausted: the node's own connection refuses a 9th frame
                    assert node.channel.conn.stream_credit(sid) == 0
                    await wait_until(lambda: replies.buffered() == window)  # type: ignore[attr-defined]
                    for _ in range(window // 2):
                        await replies.__anext__()
                    credit = await node.receive(Credit)
                    assert credit.frames == window // 4
                    await wait_until(lambda: node.channel.conn.stream_credit(sid) == window // 2)
                    await node.send(RunEvent(stream_id=sid, kind="complete"))


async def test_node_overrunning_its_window_is_closed() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req(window=2)) as replies:
                    req = await node.receive(RunRequest)
                    for i in range(3):  # bypass the node-side check
                        await node.send_raw(
                            encode_frame(
                                RunEvent(stream_id=req.stream_id, kind="text", text=str(i))
                            )
                        )
                    with pytest.raises(NodeDispatchError):
                        async for _ in replies:
                            pass
                await wait_until(lambda: ("disconnect", "node-a") in rec.events)
                assert any("credit window" in r for r in rec.protocol_errors)


# ------------------------------------------------------------------ config push


async def test_push_config_and_errors() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            with pytest.raises(NodeDispatchError, match="not connected"):
                await hub.push_config("node-a", NodeConfig(stream_id=0, version=2), timeout=1)
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-a", token=TOKENS["node-a"]
            ) as node:
                await wait_until(lambda: hub.session("node-a") is not None)
                ack = await hub.push_config(
                    "node-a", NodeConfig(stream_id=99, version=2), timeout=1
                )
                assert ack.version == 2 and ack.ok
                assert node.config is not None and node.config.version == 2
                assert node.config.stream_id != 99  # the hub assigned it
                node._ack_config = False
                with pytest.raises(NodeDispatchError, match="did not acknowledge"):
                    await hub.push_config("node-a", NodeConfig(stream_id=0, version=3), timeout=0.2)


async def test_aclose_ends_sessions_and_refuses_new_nodes() -> None:
    rec = HubRecorder(TOKENS)
    hub = make_hub(rec)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            _h, port = await nursery.start(serve_wire, hub.handle_connection, "127.0.0.1", 0)
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req()) as replies:
                    await node.receive(RunRequest)
                    await hub.aclose("edge shutting down")
                    with pytest.raises(NodeDispatchError):
                        await replies.__anext__()
                assert await node.wait_closed() is not None
            async with FakeNode.connect(
                "127.0.0.1", port, node_id="node-b", token=TOKENS["node-b"]
            ) as late:
                assert isinstance(late.hello_reply, Refused)
            assert rec.events == [("connect", "node-a"), ("disconnect", "node-a")]
            nursery.cancel_scope.cancel()


async def test_a_retired_session_finishes_its_streams_then_ends() -> None:
    """A node removed by a refresh: out of routing at once (``node_disconnected``),
    its open stream runs to its end, no new stream opens, then the session ends."""
    with trio.fail_after(10):
        async with running_hub() as (hub, port, rec):
            async with node_with_session(hub, port) as (node, session):
                async with session.open_stream(run_req()) as replies:
                    req = await node.receive(RunRequest)
                    hub.retire("node-a", "removed from the config by a refresh")
                    assert hub.session("node-a") is None
                    assert rec.events == [("connect", "node-a"), ("disconnect", "node-a")]
                    with pytest.raises(NodeDispatchError):
                        async with session.open_stream(run_req()):
                            pass  # pragma: no cover - refused before it opens
                    await trio.sleep(0.05)
                    assert session.alive  # still serving the stream in flight
                    await node.send(RunEvent(stream_id=req.stream_id, kind="text", text="x"))
                    await node.send(RunEvent(stream_id=req.stream_id, kind="complete"))
                    assert [m.kind async for m in replies] == ["text", "complete"]  # type: ignore[union-attr]
                await wait_until(lambda: not session.alive)
                assert session.end_reason == "removed from the config by a refresh"
                assert rec.events == [("connect", "node-a"), ("disconnect", "node-a")]  # told once


async def test_retiring_an_idle_session_ends_it_at_once_and_an_unknown_id_is_a_no_op() -> None:
    with trio.fail_after(10):
        async with running_hub() as (hub, port, _rec):
            hub.retire("nobody", "removed")
            async with node_with_session(hub, port) as (_node, session):
                hub.retire("node-a", "removed")
                await wait_until(lambda: not session.alive)
