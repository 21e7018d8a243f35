"""Scripted wire peers over the real transport, for tests of either daemon.

* ``FakeNode`` — dials a real edge wire listener (e.g. ``serve_wire`` running
  ``NodeHub.handle_connection``), handshakes, acks the pushed ``NodeConfig``,
  and then lets the test read what the edge sends and reply by hand, or
  answers every request with a ``responder`` script::

      async with FakeNode.connect(host, port, node_id="node-a", token="tok") as node:
          req = await node.receive(RunRequest)
          await node.send(RunEvent(stream_id=req.stream_id, kind="complete"))

      # or fully scripted:
      def script(req):  # -> the replies to send, terminal last
          return [RunEvent(stream_id=req.stream_id, kind="text", text="hi"),
                  RunEvent(stream_id=req.stream_id, kind="complete")]
      async with FakeNode.connect(host, port, node_id="node-a", token="tok",
                                  responder=script) as node: ...

* ``FakeEdge`` — a wire listener on port 0 playing the edge for ``NodeLink``
  tests: it runs the edge's SCRAM challenge (``iopd.edge.nodes.challenge``)
  against a verifier of ``token`` (default ``FAKE_NODE_TOKEN``), answers
  ``HelloAck`` (or a scripted ``Refused``), pushes a ``NodeConfig`` and waits
  for the ack; then the test sends ``RunRequest``/``Cancel``/``Credit`` and
  reads the replies::

      async with FakeEdge.serve() as edge:      # edge.host, edge.port
          ...start a NodeLink dialing edge.address...
          session = await edge.accept()         # handshake + config done
          sid = session.next_stream_id()
          await session.send(RunRequest(stream_id=sid, provider_id="p", adapter="echo", target="m"))
          reply = await session.receive(RunEvent)

* ``HubRecorder`` — a ``NodeHub`` owner (``iopd.edge.nodes.hub.HubOwner``) with a
  fixed node registry that records every event the hub tells it::

      rec = HubRecorder({"node-a": "token-a"})
      hub = NodeHub(HubSettings(edge_id="edge-1", ...), owner=rec)

Both peers use the real ``Connection`` and ``WireChannel``, so protocol violations are
caught on the fake side too; ``send_raw`` bypasses that for bad-peer tests.
Heartbeats are answered automatically.  Every read waits at most
``timeout`` seconds (default 10) so a broken test fails instead of hanging.
"""

from __future__ import annotations

import functools
import hashlib
import ssl
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import trio
import trio.testing

from iopd.config.schema import NodeEntry
from iopd.edge.nodes.challenge import Refusal, SecretForm, challenge_node
from iopd.transport.channel import ChannelClosed, WireChannel
from iopd.transport.dial import DialError, dial
from iopd.transport.listen import serve_wire
from wire import scram
from wire.connection import Connection, Role
from wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    ControlState,
    Hello,
    HelloAck,
    Message,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    Proof,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
    RunRequest,
)

M = TypeVar("M")
#: The token ``FakeEdge`` expects unless told another.
FAKE_NODE_TOKEN = "node-token"
#: Iterations of the verifiers test peers make: the least SCRAM allows, so
#: the node derives its key inline (no worker thread under ``autojump_clock``).
TEST_ITERATIONS = scram.MIN_ITERATIONS
INBOX_SIZE = 10_000
Responder = Callable[[RunRequest | ProviderTunnelRequest], Sequence[RunEvent | ProviderTunnelFrame]]


async def wait_until(
    predicate: Callable[[], object], *, poll: float = 0.001, timeout: float = 10.0
) -> None:
    """Poll ``predicate`` until true: for state of the code under test that has no event.

    Under ``autojump_clock`` the polling costs no real time.
    """
    with trio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on but the state itself
            await trio.sleep(poll)


class _Peer:
    """What FakeNode and FakeEdgeSession share: an inbox fed by the channel's reader."""

    def __init__(self, channel: WireChannel, *, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout
        self.received: list[Message] = []  # everything but heartbeats, in order
        self._inbox_send, self._inbox = trio.open_memory_channel[Message](INBOX_SIZE)
        self.closed_reason: str | None = None
        self.closed = trio.Event()

    async def send(self, msg: Message) -> None:
        """Send one message through the real connection (legality checked)."""
        await self.channel.send(msg)

    async def send_raw(self, data: bytes) -> None:
        """Write raw bytes to the stream, bypassing the protocol checks."""
        await self.channel.stream.send_all(data)

    async def receive(self, kind: type[M] | None = None) -> M:
        """The next message from the peer (of type ``kind``, skipping others)."""
        with trio.fail_after(self.timeout):
            while True:
                msg = await self._inbox.receive()
                if kind is None or isinstance(msg, kind):
                    return msg  # type: ignore[return-value]

    def _store(self, msg: Message) -> None:
        self.received.append(msg)
        self._inbox_send.send_nowait(msg)

    async def _serve(
        self, dispatch: Callable[[Message], None], interval: float, timeout: float
    ) -> None:
        try:
            await self.channel.serve(
                dispatch, heartbeat_interval=interval, heartbeat_timeout=timeout
            )
        except ChannelClosed as exc:
            self.closed_reason = exc.reason
        finally:
            self._inbox_send.close()
            self.closed.set()

    async def wait_closed(self) -> str | None:
        """Wait until the connection is gone; return the reason."""
        with trio.fail_after(self.timeout):
            await self.closed.wait()
        return self.closed_reason

    async def aclose(self) -> None:
        """Close the connection now."""
        await self.channel.aclose("test closed it")


class FakeNode(_Peer):
    """A scripted node over the real transport.  See the module docstring."""

    hello_reply: HelloAck | Refused
    config: NodeConfig | None = None

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        node_id: str,
        token: str,
        protocol_version: int = PROTOCOL_VERSION,
        ack_config: bool = True,
        config_ok: bool = True,
        responder: Responder | None = None,
        status: ProviderStatus | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float = 10.0,
    ) -> AsyncIterator[FakeNode]:
        """Dial, handshake, and serve in the background until the block ends.

        ``node.hello_reply`` is the edge's HelloAck or Refused (after Refused the
        node is closed).  With ``ack_config`` every NodeConfig is acked
        (``ok=config_ok``) automatically; ``status`` is sent after the first ack.
        """
        stream = await dial(
            host,
            port,
            ssl_context=ssl_context,
            server_hostname=server_hostname,
            connect_timeout=timeout,
        )
        channel = WireChannel(stream, Connection(Role.NODE), name="fake-node")
        node = cls(channel, timeout=timeout)
        node._ack_config, node._config_ok, node._responder = ack_config, config_ok, responder
        node._status = status
        try:
            with trio.fail_after(timeout):
                reply = await node_handshake(
                    channel, node_id=node_id, token=token, protocol_version=protocol_version
                )
            node.hello_reply = reply
            if isinstance(reply, Refused):
                node.closed.set()
                yield node
                return
            async with trio.open_nursery() as nursery:
                node._nursery = nursery
                nursery.start_soon(
                    node._serve, node._dispatch, reply.heartbeat_interval, reply.heartbeat_timeout
                )
                yield node
                nursery.cancel_scope.cancel()
        finally:
            await channel.aclose()

    _ack_config: bool
    _config_ok: bool
    _responder: Responder | None
    _status: ProviderStatus | None
    _nursery: trio.Nursery

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, NodeConfig) and self._ack_config:
            first = self.config is None
            self.config = msg
            self.received.append(msg)
            self.channel.post(
                NodeConfigAck(stream_id=msg.stream_id, version=msg.version, ok=self._config_ok)
            )
            if first and self._status is not None:
                self.channel.post(self._status)
            return
        if isinstance(msg, RunRequest | ProviderTunnelRequest) and self._responder is not None:
            self.received.append(msg)
            for reply in self._responder(msg):
                self.channel.post(reply)
            return
        self._store(msg)


async def node_handshake(
    channel: WireChannel,
    *,
    node_id: str,
    token: str,
    protocol_version: int = PROTOCOL_VERSION,
    nonce: str | None = None,
) -> HelloAck | Refused:
    """The node's side of the handshake, without checking the edge's signature
    (tests do that where it matters); the edge's last reply."""
    client_nonce = nonce or scram.new_nonce()
    await channel.send(
        Hello(protocol_version=protocol_version, node_id=node_id, token="", nonce=client_nonce)
    )
    reply = await channel.receive_message()
    if isinstance(reply, Refused):
        return reply
    assert isinstance(reply, Challenge)
    secret = token if reply.secret == "token" else scram.token_sha256(token)
    salted = scram.salted_password(secret, reply.salt, reply.iterations)
    auth = scram.auth_message(node_id, client_nonce, reply.nonce, reply.salt, reply.iterations)
    await channel.send(Proof(proof=scram.client_proof(salted, auth)))
    reply = await channel.receive_message()
    assert isinstance(reply, HelloAck | Refused)
    return reply


#: A well-formed Challenge and Proof for tests of the connection and the
#: channel, where only the handshake's shape matters (not its math).
SAMPLE_CHALLENGE = Challenge(nonce="n" * 40, salt=b"salt", iterations=TEST_ITERATIONS)
SAMPLE_PROOF = Proof(proof=bytes(32))


async def challenge_and_prove(edge: WireChannel, node: WireChannel) -> None:
    """The middle of a handshake between two scripted channels (Hello already crossed)."""
    await edge.send(SAMPLE_CHALLENGE)
    assert isinstance(await node.receive_message(), Challenge)
    await node.send(SAMPLE_PROOF)
    assert isinstance(await edge.receive_message(), Proof)


async def handshaken_channels(
    edge_stream: trio.abc.Stream, node_stream: trio.abc.Stream
) -> tuple[WireChannel, WireChannel]:
    """Two scripted channels (edge, node) over the given streams, the handshake done."""
    edge = WireChannel(edge_stream, Connection(Role.EDGE))
    node = WireChannel(node_stream, Connection(Role.NODE))
    await node.send(Hello(protocol_version=PROTOCOL_VERSION, node_id="n", token="t"))
    assert isinstance(await edge.receive_message(), Hello)
    await challenge_and_prove(edge, node)
    await edge.send(HelloAck(edge_id="e"))
    assert isinstance(await node.receive_message(), HelloAck)
    return edge, node


class FakeEdgeSession(_Peer):
    """One node connection accepted by ``FakeEdge``, after handshake and config."""

    hello: Hello
    config_ack: NodeConfigAck | None = None
    _last_stream_id: int = 0

    def next_stream_id(self) -> int:
        """A fresh stream id for the next request the test sends."""
        self._last_stream_id = max(self._last_stream_id, self.channel.conn.last_stream_id) + 1
        return self._last_stream_id

    def _dispatch(self, msg: Message) -> None:
        self._store(msg)


class FakeEdge:
    """A wire listener playing the edge.  See the module docstring."""

    def __init__(
        self,
        *,
        token: str,
        node_config: NodeConfig | None,
        refuse: Refused | None,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        timeout: float,
        secret: SecretForm = "token",
    ) -> None:
        keyed_by = token if secret == "token" else scram.token_sha256(token)
        self.verifier = scram.Verifier.create(keyed_by, iterations=TEST_ITERATIONS)
        self.secret: SecretForm = secret
        self.node_config = node_config
        self.refuse = refuse
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.timeout = timeout
        self.host = ""
        self.port = 0
        self.hellos: list[Hello] = []  # every Hello seen, accepted or not
        self.dial_times: list[float] = []  # in_memory only
        self._accepted_send, self._accepted = trio.open_memory_channel[FakeEdgeSession](100)

    @property
    def address(self) -> str:
        """``host:port`` for a node config's ``edge`` key."""
        return f"{self.host}:{self.port}"

    @classmethod
    @asynccontextmanager
    async def serve(
        cls,
        *,
        token: str = FAKE_NODE_TOKEN,
        node_config: NodeConfig | None = None,
        refuse: Refused | None = None,
        heartbeat_interval: float = 5.0,
        heartbeat_timeout: float = 15.0,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = 10.0,
        secret: SecretForm = "token",
    ) -> AsyncIterator[FakeEdge]:
        """Listen on 127.0.0.1 port 0 until the block ends.

        ``token``: the node's token (a proof of another is refused: bad_token).
        ``node_config``: pushed after HelloAck (default: an empty config,
        version 1); ``refuse``: answer every Hello with this instead.
        ``secret``: the proof the ``Challenge`` asks for; ``token_sha256`` plays
        an edge (or an impostor) that holds only the hash of ``token``.
        """
        edge = cls(
            token=token,
            node_config=node_config or NodeConfig(stream_id=1, version=1),
            refuse=refuse,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            timeout=timeout,
            secret=secret,
        )
        async with trio.open_nursery() as nursery:
            edge.host, edge.port = await nursery.start(
                functools.partial(serve_wire, ssl_context=ssl_context), edge._handle, "127.0.0.1", 0
            )
            yield edge
            nursery.cancel_scope.cancel()

    @classmethod
    @asynccontextmanager
    async def in_memory(
        cls,
        *,
        token: str = FAKE_NODE_TOKEN,
        node_config: NodeConfig | None = None,
        refuse: Refused | None = None,
        heartbeat_interval: float = 5.0,
        heartbeat_timeout: float = 15.0,
        silent: bool = False,
        timeout: float = 10.0,
        secret: SecretForm = "token",
    ) -> AsyncIterator[FakeEdge]:
        """Like ``serve`` but without sockets, for ``autojump_clock`` tests.

        ``edge.dial`` is a drop-in replacement for ``iopd.transport.dial.dial``
        (monkeypatch it where the code under test imported it): each call
        records ``trio.current_time()`` in ``edge.dial_times`` and returns one
        end of an in-memory stream pair, or raises ``DialError`` while
        ``edge.down`` is true.  ``silent``: after the config ack the edge
        neither reads nor writes (a hung peer).
        """
        edge = cls(
            token=token,
            node_config=node_config or NodeConfig(stream_id=1, version=1),
            refuse=refuse,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            timeout=timeout,
            secret=secret,
        )
        edge.silent = silent
        async with trio.open_nursery() as nursery:
            edge._nursery = nursery
            yield edge
            nursery.cancel_scope.cancel()

    silent: bool = False
    down: bool = False
    _nursery: trio.Nursery | None = None

    async def dial(self, host: str, port: int, **_kwargs: object) -> trio.abc.Stream:
        """In-memory ``dial`` (see ``in_memory``)."""
        self.dial_times.append(trio.current_time())
        if self.down:
            raise DialError("fake edge is down", "broken")
        assert self._nursery is not None, "dial() needs FakeEdge.in_memory()"
        client, server = trio.testing.memory_stream_pair()
        self._nursery.start_soon(self._handle_and_close, server)
        return client

    async def _handle_and_close(self, stream: trio.abc.Stream) -> None:
        try:
            await self._handle(stream)
        finally:
            await trio.aclose_forcefully(stream)

    async def accept(self) -> FakeEdgeSession:
        """The next node connection that completed the handshake and config push."""
        with trio.fail_after(self.timeout):
            return await self._accepted.receive()

    async def _handle(self, stream: trio.abc.Stream) -> None:
        channel = WireChannel(stream, Connection(Role.EDGE), name="fake-edge")
        session = FakeEdgeSession(channel, timeout=self.timeout)
        try:
            hello = await channel.receive_message()
        except ChannelClosed:
            return
        assert isinstance(hello, Hello)
        self.hellos.append(hello)
        session.hello = hello
        if self.refuse is not None:
            await channel.send(self.refuse)
            await channel.aclose()
            return
        try:
            outcome = await challenge_node(channel, hello, self.verifier, self.secret)
        except ChannelClosed:
            return
        if isinstance(outcome, Refusal):
            await channel.send(Refused(reason=outcome.reason, code=outcome.code))
            await channel.aclose()
            return
        await channel.send(
            HelloAck(
                edge_id="fake-edge",
                heartbeat_interval=self.heartbeat_interval,
                heartbeat_timeout=self.heartbeat_timeout,
                server_signature=outcome,
            )
        )
        if self.silent:
            if self.node_config is not None:
                await channel.send(self.node_config)
            await trio.sleep_forever()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                session._serve, session._dispatch, self.heartbeat_interval, self.heartbeat_timeout
            )
            if self.node_config is not None:
                await channel.send(self.node_config)
                try:
                    session.config_ack = await session.receive(NodeConfigAck)
                except (trio.EndOfChannel, trio.TooSlowError):
                    return
            self._accepted_send.send_nowait(session)


@dataclass
class HubRecorder:
    """A ``NodeHub`` owner for tests: nodes ``tokens`` (id -> token), every event kept.

    ``events``: ``("connect" | "disconnect", node_id)`` in order; ``statuses``:
    the provider status reports; ``frames``: frames counted by direction;
    ``wire_errors``: ``(reason, detail)`` of every wire error.
    """

    tokens: Mapping[str, str]
    config_version: int = 7
    #: node id -> ``token_verifier`` string: these nodes hold the strong form
    #: (the others the hash of their token).
    verifiers: dict[str, str] = field(default_factory=dict)
    events: list[tuple[str, str]] = field(default_factory=list)
    statuses: list[tuple[str, ProviderStatus]] = field(default_factory=list)
    frames: dict[str, int] = field(default_factory=lambda: {"in": 0, "out": 0})
    wire_errors: list[tuple[str, str]] = field(default_factory=list)
    config_states: list[tuple[str, NodeConfigState]] = field(default_factory=list)
    control_states: list[tuple[str, ControlState]] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        """The reasons of ``wire_errors`` (the metric's label values)."""
        return [reason for reason, _ in self.wire_errors]

    @property
    def protocol_errors(self) -> list[str]:
        """Details of the wire errors that were the peer's fault on the wire:
        protocol failures and handshake timeouts (not refusals, not heartbeats)."""
        return [
            detail
            for reason, detail in self.wire_errors
            if reason != "heartbeat_timeout" and not detail.startswith("refused")
        ]

    def known_nodes(self) -> Mapping[str, NodeEntry]:
        return {
            nid: NodeEntry(id=nid, token_verifier=self.verifiers[nid])
            if nid in self.verifiers
            else NodeEntry(id=nid, token_hash_sha256=hashlib.sha256(tok.encode()).hexdigest())
            for nid, tok in self.tokens.items()
        }

    def node_config(self, node_id: str) -> NodeConfig:
        return NodeConfig(stream_id=0, version=self.config_version)

    def node_connected(self, node_id: str) -> None:
        self.events.append(("connect", node_id))

    def node_disconnected(self, node_id: str) -> None:
        self.events.append(("disconnect", node_id))

    def provider_status(self, node_id: str, msg: ProviderStatus) -> int:
        self.statuses.append((node_id, msg))
        return 0

    def node_config_state(self, node_id: str, msg: NodeConfigState) -> None:
        self.config_states.append((node_id, msg))

    def node_controls(self, node_id: str, msg: ControlState) -> None:
        self.control_states.append((node_id, msg))

    def wire_frames(self, direction: str, n: int) -> None:
        self.frames[direction] += n

    def wire_error(self, reason: str, detail: str) -> None:
        self.wire_errors.append((reason, detail))


__all__ = [
    "FAKE_NODE_TOKEN",
    "FakeEdge",
    "FakeEdgeSession",
    "FakeNode",
    "HubRecorder",
    "SAMPLE_CHALLENGE",
    "SAMPLE_PROOF",
    "challenge_and_prove",
    "node_handshake",
    "wait_until",
]
