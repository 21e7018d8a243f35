"""The trio transport: WireChannel, serve_wire, dial + Backoff, TLS (trustme certs)."""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from iopd.config.schema import EdgeTLS, NodeSection, NodeTLS
from iopd.edge.nodes.hub import HubSettings, NodeHub
from iopd.node.link import NodeLink
from iopd.transport import (
    Backoff,
    ChannelClosed,
    DialError,
    TLSConfigError,
    WireChannel,
    client_ssl_context,
    dial,
    serve_wire,
    server_ssl_context,
)
from tests.support.node_parts import ScriptedHandler
from tests.support.streams import CountingStream
from tests.support.wire_peers import (
    FakeEdge,
    FakeNode,
    HubRecorder,
    challenge_and_prove,
    handshaken_channels,
    wait_until,
)
from wire import scram
from wire.connection import Connection, Role
from wire.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    Pong,
    RunEvent,
    RunRequest,
)

# ------------------------------------------------------------------ channel


async def _open_pair() -> tuple[WireChannel, WireChannel]:
    """Two channels (edge, node) over memory streams, handshake done."""
    return await handshaken_channels(*trio.testing.memory_stream_pair())


async def test_channel_answers_heartbeat_with_pong_and_dispatches_the_rest() -> None:
    edge, node = await _open_pair()
    seen: list[Message] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_quietly, node, seen.append, 100.0, 1000.0)
            await edge.send(Heartbeat(seq=41))
            assert await edge.receive_message() == Pong(seq=41)
            await edge.send(RunRequest(stream_id=1, provider_id="p", adapter="echo", target="m"))
            await wait_until(lambda: len(seen) == 1)
            assert isinstance(seen[0], RunRequest)  # heartbeats are not dispatched
            nursery.cancel_scope.cancel()


async def _serve_quietly(
    chan: WireChannel, dispatch: object, interval: float, timeout: float
) -> None:
    try:
        await chan.serve(dispatch, heartbeat_interval=interval, heartbeat_timeout=timeout)  # type: ignore[arg-type]
    except ChannelClosed:
        pass


async def test_channel_sends_heartbeats_and_times_out_silent_peer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    edge, node = await _open_pair()
    with trio.fail_after(100):
        start = trio.current_time()
        with pytest.raises(ChannelClosed) as info:
            await node.serve(lambda m: None, heartbeat_interval=2.0, heartbeat_timeout=7.0)
        assert info.value.kind == "heartbeat"
        assert trio.current_time() - start == pytest.approx(7.0)
        # it did send heartbeats meanwhile (3 of them: at 2, 4, 6 s)
        msgs = edge.conn.receive_data(await edge.stream.receive_some(65536))
        assert [m for m in msgs if isinstance(m, Heartbeat)] == [
            Heartbeat(seq=1),
            Heartbeat(seq=2),
            Heartbeat(seq=3),
        ]
    assert node.closed


async def test_channel_peer_eof_and_protocol_error() -> None:
    with trio.fail_after(5):
        edge, node = await _open_pair()
        await edge.aclose()
        with pytest.raises(ChannelClosed) as info:
            await node.serve(lambda m: None, heartbeat_interval=10, heartbeat_timeout=30)
        assert info.value.kind in ("eof", "broken")
        with pytest.raises(ChannelClosed):
            await node.send(Heartbeat())

        edge, node = await _open_pair()
        await edge.stream.send_all(b"\x00\x00\x00\x00")  # zero-length frame
        with pytest.raises(ChannelClosed) as info:
            await node.serve(lambda m: None, heartbeat_interval=10, heartbeat_timeout=30)
        assert info.value.kind == "protocol"
        assert "zero-length" in info.value.reason
        assert isinstance(info.value, trio.BrokenResourceError)


async def test_cancelled_sender_never_leaves_half_a_frame() -> None:
    a, b = trio.testing.lockstep_stream_pair()  # every send waits for the reader
    edge = WireChannel(a, Connection(Role.EDGE))
    node = WireChannel(b, Connection(Role.NODE))
    hello = Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t" * 1000)
    done: list[str] = []

    async def sender(scope: trio.CancelScope) -> None:
        with scope:
            await node.send(hello)
            done.append("sent")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            nursery.start_soon(sender, scope)
            await trio.testing.wait_all_tasks_blocked()  # blocked inside send_all
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert done == []  # the cancel did not abort the write half-way
            assert await edge.receive_message() == hello  # the whole frame arrives
            await wait_until(lambda: done == ["sent"])


# ------------------------------------------------------------------ listen


async def test_serve_wire_reports_port_and_survives_handler_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    async def handler(stream: trio.abc.Stream) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        await stream.send_all(b"ok")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve_wire, handler, "127.0.0.1", 0)
            assert host == "127.0.0.1" and port > 0
            first = await trio.open_tcp_stream(host, port)
            assert await first.receive_some(10) == b""  # closed after the error
            second = await trio.open_tcp_stream(host, port)
            assert await second.receive_some(10) == b"ok"
            await first.aclose()
            await second.aclose()
            nursery.cancel_scope.cancel()
    assert "event=wire_handler_failed" in caplog.text


# ------------------------------------------------------------------ dial + backoff


async def test_dial_refused_is_dial_error() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    with trio.fail_after(5), pytest.raises(DialError) as info:
        await dial("127.0.0.1", port, connect_timeout=2)
    assert f"127.0.0.1:{port}" in info.value.reason


async def test_dial_tls_handshake_timeout(autojump_clock: trio.testing.MockClock) -> None:
    # A TCP listener that never speaks TLS: the handshake times out.
    async def silent(stream: trio.abc.Stream) -> None:
        await trio.sleep_forever()

    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, silent, 0)
            port = listeners[0].socket.getsockname()[1]
            ctx = ssl.create_default_context()
            with pytest.raises(DialError, match="timed out"):
                await dial("127.0.0.1", port, ssl_context=ctx, connect_timeout=3)
            nursery.cancel_scope.cancel()


def test_backoff_full_jitter_and_cap() -> None:
    values = iter([1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0])
    b = Backoff(0.5, 4.0, rng=lambda: next(values))
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.next() == 2.0  # jitter: half of the capped ceiling
    assert b.next() == 0.0
    b.reset()
    assert b.ceiling() == 0.5
    with pytest.raises(ValueError):
        Backoff(0, 1)


def test_backoff_random_delays_within_bounds() -> None:
    b = Backoff(0.5, 30.0)
    for attempt in range(200):
        ceiling = b.ceiling()
        assert ceiling == min(30.0, 0.5 * 2**attempt)
        assert 0.0 <= next(b) <= ceiling
    assert 15.0 <= b.max_delay() <= 30.0


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, an edge server cert for 127.0.0.1/localhost and a node client cert, on disk."""
    d: Path = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("node-a.iopd.test")
    paths = {
        "ca": d / "ca.pem",
        "server_cert": d / "server.pem",
        "server_key": d / "server.key",
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["server_cert"]))
    server.private_key_pem.write_to_path(str(paths["server_key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    return {k: str(v) for k, v in paths.items()}


def test_tls_contexts_from_config(pki: dict[str, str]) -> None:
    assert server_ssl_context(EdgeTLS()) is None
    assert client_ssl_context(NodeTLS()) is None
    srv = server_ssl_context(
        EdgeTLS(cert=pki["server_cert"], key=pki["server_key"], client_ca=pki["ca"])
    )
    assert srv is not None and srv.verify_mode == ssl.CERT_REQUIRED
    srv2 = server_ssl_context(EdgeTLS(cert=pki["server_cert"], key=pki["server_key"]))
    assert srv2 is not None and srv2.verify_mode == ssl.CERT_NONE
    with pytest.raises(TLSConfigError):
        server_ssl_context(EdgeTLS(cert=pki["server_cert"]))
    with pytest.raises(TLSConfigError):
        client_ssl_context(NodeTLS(ca=pki["ca"], cert=pki["client_cert"]))
    with pytest.raises(TLSConfigError):
        server_ssl_context(EdgeTLS(cert="/nonexistent.pem", key="/nonexistent.key"))


TOKEN = "tls-node-token"


async def test_mutual_tls_hub_and_link(pki: dict[str, str]) -> None:
    """A NodeLink with a client cert reaches a NodeHub requiring one; a node without is refused."""
    srv = server_ssl_context(
        EdgeTLS(cert=pki["server_cert"], key=pki["server_key"], client_ca=pki["ca"])
    )
    rec = HubRecorder(
        {"node-a": TOKEN},
        config_version=1,
        verifiers={"node-a": scram.Verifier.create(TOKEN, iterations=scram.MIN_ITERATIONS).encode()},
    )
    events = rec.events
    hub = NodeHub(
        HubSettings(
            edge_id="edge-tls",
            heartbeat_interval=5,
            heartbeat_timeout=15,
            handshake_timeout=5,
            max_frame_bytes=1 << 20,
        ),
        owner=rec,
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(_serve_tls, hub.handle_connection, srv)
            cfg = NodeSection(
                id="node-a",
                edge=f"{host}:{port}",
                token=TOKEN,
                tls=NodeTLS(ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"]),
            )
            link = NodeLink(cfg, ScriptedHandler(), software_version="1")
            nursery.start_soon(link.run)
            await link.wait_connected()
            await wait_until(lambda: hub.session("node-a") is not None)
            session = hub.session("node-a")
            assert session is not None
            req = RunRequest(
                stream_id=0, provider_id="p", adapter="echo", target="m", metadata={"n": "2"}
            )
            async with session.open_stream(req) as replies:
                kinds = [m.kind async for m in replies]  # type: ignore[union-attr]
            assert kinds == ["text", "text", "complete"]

            # without a client certificate the TLS handshake fails
            no_cert = client_ssl_context(NodeTLS(ca=pki["ca"]))
            with pytest.raises((DialError, ChannelClosed)):
                async with FakeNode.connect(
                    host, port, node_id="node-a", token=TOKEN, ssl_context=no_cert
                ):
                    pass
            # a client that does not trust the edge's CA fails too
            with pytest.raises(DialError):
                await dial(host, port, ssl_context=ssl.create_default_context(), connect_timeout=5)
            assert events == [("connect", "node-a")]
            nursery.cancel_scope.cancel()


async def _serve_tls(
    handler: object, ctx: ssl.SSLContext, *, task_status: trio.TaskStatus[tuple[str, int]]
) -> None:
    await serve_wire(handler, "127.0.0.1", 0, ssl_context=ctx, task_status=task_status)  # type: ignore[arg-type]


async def test_server_tls_without_client_certs(pki: dict[str, str]) -> None:
    srv = server_ssl_context(EdgeTLS(cert=pki["server_cert"], key=pki["server_key"]))
    assert srv is not None
    client = client_ssl_context(NodeTLS(ca=pki["ca"]))
    with trio.fail_after(10):
        async with FakeEdge.serve(token="t", ssl_context=srv) as edge:
            async with FakeNode.connect(
                edge.host,
                edge.port,
                node_id="n",
                token="t",
                ssl_context=client,
                server_hostname="localhost",
            ) as node:
                assert isinstance(node.hello_reply, HelloAck)
                session = await edge.accept()
                await session.send(
                    RunRequest(stream_id=2, provider_id="p", adapter="echo", target="m")
                )
                req = await node.receive(RunRequest)
                await node.send(RunEvent(stream_id=req.stream_id, kind="complete"))
                assert (await session.receive(RunEvent)).kind == "complete"


async def test_concurrent_senders_are_coalesced_in_call_order() -> None:
    a, b = trio.testing.memory_stream_pair()  # send_all yields: senders pile up
    counting = CountingStream(b)
    edge = WireChannel(a, Connection(Role.EDGE))
    node = WireChannel(counting, Connection(Role.NODE))
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await node.send(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t"))
            assert isinstance(await edge.receive_message(), Hello)
            await challenge_and_prove(edge, node)
            await edge.send(HelloAck(edge_id="e"))
            await edge.send(
                RunRequest(stream_id=1, provider_id="p", adapter="echo", target="m", window=100)
            )
            assert isinstance(await node.receive_message(), HelloAck)
            assert isinstance(await node.receive_message(), RunRequest)
            writes_before = counting.writes
            call_order: list[str] = []

            async def send_one(text: str) -> None:
                call_order.append(text)  # no checkpoint between this and send()
                await node.send(RunEvent(stream_id=1, kind="text", text=text))

            for i in range(50):
                nursery.start_soon(send_one, str(i))
            got = [await edge.receive_message() for _ in range(50)]
    # frames arrive whole, each once, in the order the senders called send()
    assert [m.text for m in got] == call_order  # type: ignore[union-attr]
    assert sorted(call_order, key=int) == [str(i) for i in range(50)]
    assert counting.writes - writes_before < 50  # and were batched into fewer writes


async def test_tls_connections_count_as_pending_until_authenticated(pki: dict[str, str]) -> None:
    """Over TLS the gate counts TCP connections: the session leaves the count, a silent one holds it."""
    srv = server_ssl_context(EdgeTLS(cert=pki["server_cert"], key=pki["server_key"]))
    assert srv is not None
    client = client_ssl_context(NodeTLS(ca=pki["ca"]))
    rec = HubRecorder({"node-a": TOKEN}, config_version=1)
    hub = NodeHub(
        HubSettings(
            edge_id="edge-tls",
            heartbeat_interval=5,
            heartbeat_timeout=15,
            handshake_timeout=5,
            max_frame_bytes=1 << 20,
            max_pending=1,
            max_pending_per_address=1,
        ),
        owner=rec,
    )
    gate = hub.listener_gate()

    async def serve(*, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        handler = functools.partial(hub.handle_connection, gate=gate)
        await serve_wire(handler, "127.0.0.1", 0, ssl_context=srv, gate=gate, task_status=task_status)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve)
            async with FakeNode.connect(
                host, port, node_id="node-a", token=TOKEN, ssl_context=client
            ) as node:
                assert isinstance(node.hello_reply, HelloAck)
                await wait_until(lambda: hub.session("node-a") is not None)
                assert gate.pending == 0
                silent = await trio.open_tcp_stream(host, port)
                await wait_until(lambda: gate.pending == 1)
                with pytest.raises((DialError, ChannelClosed)):  # the one slot is taken
                    async with FakeNode.connect(
                        host, port, node_id="node-a", token=TOKEN, ssl_context=client, timeout=3
                    ):
                        pass
                assert rec.errors == ["pending_limit"]
                await silent.aclose()
                await wait_until(lambda: gate.pending == 0)
                assert hub.session("node-a") is not None
            nursery.cancel_scope.cancel()
