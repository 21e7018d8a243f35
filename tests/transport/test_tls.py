"""TLS on the wire (trustme certs): contexts from config, mutual TLS between hub and link,
server-only TLS, and the pending gate counting TLS connections until they authenticate."""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from iopd.config.schema import EdgeTLS, NodeSection, NodeTLS
from iopd.node.edges.link import NodeLink
from iopd.transport import (
    ChannelClosed,
    DialError,
    TLSConfigError,
    client_ssl_context,
    dial,
    serve_wire,
    server_ssl_context,
)
from tests.support.hubs import make_hub
from tests.support.node_parts import ScriptedHandler
from tests.support.wire_peers import FakeEdge, FakeNode, HubRecorder, wait_until
from wire import scram
from wire.messages import HelloAck, RunEvent, RunRequest


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
    hub = make_hub(rec, edge_id="edge-tls", handshake_timeout=5)
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


async def test_tls_connections_count_as_pending_until_authenticated(pki: dict[str, str]) -> None:
    """Over TLS the gate counts TCP connections: the session leaves the count, a silent one holds it."""
    srv = server_ssl_context(EdgeTLS(cert=pki["server_cert"], key=pki["server_key"]))
    assert srv is not None
    client = client_ssl_context(NodeTLS(ca=pki["ca"]))
    rec = HubRecorder({"node-a": TOKEN}, config_version=1)
    hub = make_hub(
        rec, edge_id="edge-tls", handshake_timeout=5, max_pending=1, max_pending_per_address=1
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
