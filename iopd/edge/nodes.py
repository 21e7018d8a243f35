"""``NodeHub``: the edge's side of the wire — one ``NodeSession`` per connected node.

Why it looks like this:

* ``handle_connection`` is the ``serve_wire`` handler: handshake (Hello checked
  against the running config, ``Refused`` otherwise, all within
  ``handshake_timeout``), then the session.  Every failure of one connection
  is caught and logged here; the hub keeps serving the others.
* A session is "ready" (returned by ``session()``, announced with
  ``on_connect``) only after the node acknowledged its first ``NodeConfig``.
  A node that rejects it (its adapters could not be built) is never
  announced: the edge logs why and closes the connection.
* A new Hello for a node id that still has a session *replaces* it: the old
  session's streams fail at once with ``NodeDispatchError`` and
  ``on_disconnect`` is called for it before the new one's ``on_connect``.
* Streams: the channel's reader task hands each reply to its stream's bounded
  buffer without ever blocking (``window`` frames + the terminal; the wire's
  credit accounting guarantees it fits — a node that sends past its window is
  a protocol error).  The consumer returns ``Credit`` as it reads.  When the
  session dies every stream still waiting for its terminal raises
  ``NodeDispatchError`` at its next read, even with frames still buffered (a
  stream that has its terminal is complete and is read to the end).  Leaving
  ``open_stream`` before the terminal sends ``Cancel`` (queued, never blocking
  the caller) and refunds the credit of unread frames; late replies of
  abandoned streams are credited and dropped.
* Metering hooks (optional): ``on_frames(direction, n)`` for every frame the
  edge's wire ``Connection`` encodes (``out``) or decodes (``in``), and
  ``on_wire_error(reason)`` once per connection closed for a wire problem, with
  ``reason`` one of ``frame_too_large``, ``malformed``, ``protocol``,
  ``handshake`` (timeout or refusal) and ``heartbeat_timeout``.  Frames are
  counted by a ``Connection`` subclass, so the transport needs no hook.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Literal

import msgspec
import trio

from iopd.config.schema import NodeEntry
from iopd.errors import NodeDispatchError
from iopd.redact import Scrubber
from iopd.transport.channel import ChannelClosed, WireChannel
from wire.connection import Connection, Role, StreamState
from wire.errors import FrameTooLarge, LocalProtocolError, MalformedFrame, RemoteProtocolError
from wire.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Credit,
    Hello,
    HelloAck,
    Message,
    NodeConfig,
    NodeConfigAck,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
    RunRequest,
    is_terminal,
)

log = logging.getLogger("iopd.edge.nodes")

Reply = RunEvent | ProviderTunnelFrame | NodeConfigAck
RefuseCode = Literal["unknown_node", "bad_token", "version_mismatch", "bad_handshake"]
FramesHook = Callable[[str, int], None]
"""``on_frames(direction, n)``: ``n`` frames went ``out`` to or came ``in`` from a node."""


class _MeteredConnection(Connection):
    """A ``Connection`` that reports frame counts and remembers why the peer failed it.

    Frames sent are tallied and reported together with the next batch read (a
    node answers every request, and heartbeats at the latest) or at close, so
    the hot send path costs an integer increment rather than a metrics call.
    """

    def __init__(self, role: Role, *, max_frame_bytes: int, on_frames: FramesHook) -> None:
        super().__init__(role, max_frame_bytes=max_frame_bytes)
        self._on_frames = on_frames
        self._unreported_out = 0
        self.remote_error: RemoteProtocolError | None = None

    def _report(self, frames_in: int) -> None:
        out, self._unreported_out = self._unreported_out, 0
        if out:
            self._on_frames("out", out)
        if frames_in:
            self._on_frames("in", frames_in)

    def send(self, msg: Message) -> bytes:
        data = super().send(msg)
        self._unreported_out += 1
        return data

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Message]:
        try:
            msgs = super().receive_data(data)
        except RemoteProtocolError as exc:
            self.remote_error = self.remote_error or exc
            self._report(0)
            raise
        self._report(len(msgs))
        return msgs

    def receive_eof(self) -> None:
        self._report(0)
        try:
            super().receive_eof()
        except RemoteProtocolError as exc:
            self.remote_error = self.remote_error or exc
            raise

    def close(self) -> None:
        self._report(0)
        super().close()


def _wire_error_reason(channel: WireChannel) -> str:
    """The ``iop_wire_protocol_errors_total`` reason of a protocol failure on ``channel``."""
    exc = getattr(channel.conn, "remote_error", None)
    if isinstance(exc, FrameTooLarge):
        return "frame_too_large"
    if isinstance(exc, MalformedFrame):
        return "malformed"
    return "protocol"


def _printable(value: str, limit: int = 64) -> str:
    """A peer-supplied string made safe for a log line."""
    return repr(value[:limit])


_URL_USERINFO = re.compile(r"(://)[^/@\s]+@")


def safe_node_reason(
    reason: str, pushed: NodeConfig, *, known_secrets: Iterable[str] = (), limit: int = 200
) -> str:
    """A node-supplied reason (e.g. a ``NodeConfigAck.error``) fit for a log line or a
    report: without the secrets the edge knows (any 8+ character piece of ``pushed``'s
    API keys or ``known_secrets``, credentials in URLs) should the node have echoed
    one, on one line, at most
    ``limit`` characters."""
    scrubber = Scrubber([*(p.api_key for p in pushed.providers), *known_secrets])
    reason = scrubber.scrub(reason, "<redacted>")
    flat = " ".join(_URL_USERINFO.sub(r"\1<redacted>@", reason).split()) or "no reason given"
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _scrubbed(msg: Reply, scrub: Callable[[str], str]) -> Reply:
    """``msg`` with its error text (a provider may have echoed a key) scrubbed.

    The node scrubs what it knows; this is the edge's own pass with every key
    of its config, at the one place node text enters the edge.
    """
    message: str = getattr(msg, "message", "")
    clean = scrub(message)
    return msg if clean is message else msgspec.structs.replace(msg, message=clean)


def _peer_name(stream: trio.abc.Stream) -> str:
    inner = getattr(stream, "transport_stream", stream)
    sock = getattr(inner, "socket", None)
    try:
        host, port = sock.getpeername()[:2] if sock is not None else ("?", 0)
    except OSError:
        return "?"
    return f"{host}:{port}"


class _ReplyStream:
    """One open stream as its consumer sees it: an async iterator of replies.

    The buffer is a plain deque: the reader appends (never blocks), the
    consumer pops.  It holds at most ``window`` non-terminal frames plus the
    terminal, because the connection's credit check rejects anything more.
    """

    def __init__(self, session: NodeSession, stream_id: int, window: int) -> None:
        self.session = session
        self.stream_id = stream_id
        self.window = window
        self._buf: deque[Reply] = deque()
        self._wakeup: trio.Event | None = None
        self._done = False  # no more deliveries (terminal, failure or abandoned)
        self._credit_batch = max(1, window // 4)
        self._unreported = 0  # consumed frames whose credit was not returned yet
        self.terminal_received = False  # by the reader
        self.terminal_consumed = False  # by the consumer
        self.error: NodeDispatchError | None = None

    # -- reader side (sync, never blocks)
    def deliver(self, msg: Reply) -> None:
        if self._done or len(self._buf) > self.window:
            raise _WindowExceeded(self.stream_id)
        self._buf.append(msg)
        if is_terminal(msg):
            self.terminal_received = True
            self._done = True
        self._wake()

    def fail(self, error: NodeDispatchError) -> None:
        if self.error is None:
            self.error = error
        self._done = True
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def buffered(self) -> int:
        return len(self._buf)

    # -- consumer side
    def __aiter__(self) -> _ReplyStream:
        return self

    async def __anext__(self) -> Reply:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self.error is not None:  # even with frames buffered: fail at once
                raise self.error
            if self.terminal_consumed:
                raise StopAsyncIteration
            if self._buf:
                break
            if self._done:
                raise NodeDispatchError(f"node {self.session.node_id} disconnected")
            wakeup = self._wakeup = trio.Event()
            await wakeup.wait()
        msg = self._buf.popleft()
        if is_terminal(msg):
            self.terminal_consumed = True
        else:
            self._unreported += 1
            if self._unreported >= self._credit_batch:
                self.session._post(Credit(stream_id=self.stream_id, frames=self._unreported))
                self._unreported = 0
        return msg

    def abandon(self) -> int:
        """The consumer left: frames whose credit the node should get back."""
        refund = self._unreported + sum(1 for m in self._buf if not is_terminal(m))
        self._unreported = 0
        self._buf.clear()
        self._done = True
        return refund


class _WindowExceeded(Exception):
    def __init__(self, stream_id: int) -> None:
        super().__init__(stream_id)
        self.stream_id = stream_id


class NodeSession:
    """The edge's live session with one node.  Obtain it from ``NodeHub.session``."""

    def __init__(self, hub: NodeHub, node_id: str, channel: WireChannel, peer: str) -> None:
        self.node_id = node_id
        self.peer = peer
        self.session_id = secrets.token_hex(8)
        self._hub = hub
        self._channel = channel
        self._streams: dict[int, _ReplyStream] = {}
        self._next_stream_id = 0
        self.ready = False  # first NodeConfig acknowledged; announced via on_connect
        self.announced = False  # on_connect was called and on_disconnect is still due
        self.connected_since: float | None = None
        self.end_reason: str | None = None

    @property
    def alive(self) -> bool:
        return self.end_reason is None

    # ---------------------------------------------------------------- streams

    @asynccontextmanager
    async def open_stream(
        self, req: RunRequest | ProviderTunnelRequest | NodeConfig
    ) -> AsyncIterator[AsyncIterator[Reply]]:
        """Send ``req`` on a fresh stream; yield an async iterator of its replies.

        The iterator ends after the terminal reply.  It raises
        ``NodeDispatchError("node <id> disconnected")`` as soon as the session
        is lost.  Leaving the block before the terminal sends ``Cancel``.
        ``req.stream_id`` is assigned here.
        """
        if not self.alive:
            raise NodeDispatchError(f"node {self.node_id} disconnected")
        window = 1 if isinstance(req, NodeConfig) else req.window
        # Ids go out in increasing order without a lock: the channel encodes
        # (and checks) each frame synchronously, in call order.
        self._next_stream_id += 1
        stream_id = self._next_stream_id
        stream = _ReplyStream(self, stream_id, window)
        self._streams[stream_id] = stream
        try:
            try:
                await self._channel.send(msgspec.structs.replace(req, stream_id=stream_id))
            except ChannelClosed:
                raise NodeDispatchError(f"node {self.node_id} disconnected") from None
            except LocalProtocolError as exc:
                raise NodeDispatchError(
                    f"cannot send the request to node {self.node_id}: {exc.reason}"
                ) from None
            yield stream
        finally:
            self._streams.pop(stream_id, None)
            refund = stream.abandon()
            opened = self._channel.conn.stream_state(stream_id) is not StreamState.IDLE
            if self.alive and opened and not stream.terminal_received:
                self._post(Cancel(stream_id=stream_id, reason="edge abandoned the stream"))
                if refund:
                    self._post(Credit(stream_id=stream_id, frames=refund))

    async def push_config(self, msg: NodeConfig, *, timeout: float) -> NodeConfigAck:
        """Send ``msg`` (its stream id is replaced) and wait for the node's ack.

        Raises ``NodeDispatchError`` when the node is lost or does not answer
        within ``timeout`` seconds.
        """
        with trio.move_on_after(timeout):
            async with self.open_stream(msg) as replies:
                async for reply in replies:
                    if isinstance(reply, NodeConfigAck):
                        return reply
            raise NodeDispatchError(f"node {self.node_id} ended the config stream without an ack")
        raise NodeDispatchError(
            f"node {self.node_id} did not acknowledge config version {msg.version} "
            f"within {timeout:g}s"
        )

    # ---------------------------------------------------------------- internals

    def _post(self, msg: Message) -> None:
        self._channel.post(msg)

    def _dispatch(self, msg: Message) -> None:
        """Called by the channel's reader for every message; never blocks."""
        if isinstance(msg, RunEvent | ProviderTunnelFrame | NodeConfigAck):
            stream = self._streams.get(msg.stream_id)
            if stream is None:
                # Abandoned stream: drop the late reply, give its credit back.
                if not is_terminal(msg):
                    self._post(Credit(stream_id=msg.stream_id, frames=1))
                return
            if self._hub.scrub is not None and getattr(msg, "message", None):
                msg = _scrubbed(msg, self._hub.scrub)
            try:
                stream.deliver(msg)
            except _WindowExceeded:
                raise RemoteProtocolError(
                    f"node overran the buffer of stream {msg.stream_id}"
                ) from None
        elif isinstance(msg, ProviderStatus):
            self._hub._call("on_status", self._hub._on_status, self.node_id, msg)

    def _end(self, reason: str) -> None:
        """End the session now (sync): every stream fails, the channel closes."""
        if self.end_reason is not None:
            return
        self.end_reason = reason
        # Tell the pool first: the leases freed by failing the streams below
        # re-examine the queue, which must no longer see this node as live
        # (else a waiter is admitted to the dead node and fails with a 502).
        self._hub._leave_session(self)
        error = NodeDispatchError(f"node {self.node_id} disconnected")
        for stream in list(self._streams.values()):
            if not stream.terminal_received:  # a finished stream keeps its replies
                stream.fail(error)
        self._channel.close_soon(reason)

    async def _run(self, heartbeat_interval: float, heartbeat_timeout: float) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve, heartbeat_interval, heartbeat_timeout, nursery)
            await self._announce()

    async def _serve(self, interval: float, timeout: float, nursery: trio.Nursery) -> None:
        try:
            await self._channel.serve(
                self._dispatch, heartbeat_interval=interval, heartbeat_timeout=timeout
            )
        except ChannelClosed as exc:
            if exc.kind == "protocol":
                self._hub._protocol_error(
                    self.node_id, self.peer, exc.reason, _wire_error_reason(self._channel)
                )
            elif exc.kind == "heartbeat":
                self._hub._wire_error("heartbeat_timeout")
            self._end(exc.reason)
        finally:
            self._end(self.end_reason or "session ended")
            nursery.cancel_scope.cancel()

    async def _announce(self) -> None:
        hub = self._hub
        try:
            cfg = hub._get_node_config(self.node_id)
            ack = await self.push_config(cfg, timeout=hub.handshake_timeout)
            # A refresh applied while that ack was pending skipped this session
            # (not ready yet): send the newer provider set before announcing.
            latest = hub._get_node_config(self.node_id)
            while latest.providers != cfg.providers:
                cfg = latest
                ack = await self.push_config(cfg, timeout=hub.handshake_timeout)
                latest = hub._get_node_config(self.node_id)
        except NodeDispatchError as exc:
            log.warning(
                "event=node_config_push node=%s peer=%s outcome=failed reason=%r",
                self.node_id,
                self.peer,
                exc.message,
            )
            self._end(f"initial config not acknowledged: {exc.message}")
            return
        if not ack.ok:
            # Its adapters could not be built: it serves nothing, so it is not
            # announced (not routable, not connected in /status); it redials.
            reason = safe_node_reason(ack.error, cfg)
            log.warning(
                "event=node_config_push node=%s outcome=rejected reason=%r version=%d peer=%s",
                self.node_id,
                reason,
                ack.version,
                self.peer,
            )
            self._end(f"node rejected its initial config: {reason}")
            return
        if not self.alive:
            return
        self.ready = True
        self.announced = True
        self.connected_since = time.time()
        log.info(
            "event=node_connected node=%s peer=%s session=%s config_version=%d",
            self.node_id,
            self.peer,
            self.session_id,
            ack.version,
        )
        hub._call("on_connect", hub._on_connect, self.node_id)


class NodeHub:
    """Every node session of the edge; the ``serve_wire`` handler lives here."""

    def __init__(
        self,
        *,
        edge_id: str,
        get_nodes: Callable[[], Mapping[str, NodeEntry]],
        get_node_config: Callable[[str], NodeConfig],
        heartbeat_interval: float,
        heartbeat_timeout: float,
        handshake_timeout: float,
        max_frame_bytes: int,
        on_connect: Callable[[str], None],
        on_disconnect: Callable[[str], None],
        on_status: Callable[[str, ProviderStatus], None],
        on_protocol_error: Callable[[str], None] | None = None,
        on_frames: FramesHook | None = None,
        on_wire_error: Callable[[str], None] | None = None,
        scrub: Callable[[str], str] | None = None,
    ) -> None:
        self.edge_id = edge_id
        #: Removes the edge's secrets from a node's error text before anyone reads it.
        self.scrub = scrub
        self._get_nodes = get_nodes
        self._get_node_config = get_node_config
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.handshake_timeout = handshake_timeout
        self.max_frame_bytes = max_frame_bytes
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_status = on_status
        self._on_protocol_error = on_protocol_error
        self._on_frames = on_frames
        self._on_wire_error = on_wire_error
        self._sessions: dict[str, NodeSession] = {}
        self._channels: set[WireChannel] = set()
        self._closing: str | None = None
        self._handlers = 0
        self._no_handlers = trio.Event()
        self._no_handlers.set()
        self.protocol_errors = 0

    # ---------------------------------------------------------------- queries

    def session(self, node_id: str) -> NodeSession | None:
        """The ready session of ``node_id`` (config acknowledged), or None."""
        session = self._sessions.get(node_id)
        if session is None or not session.ready or not session.alive:
            return None
        return session

    def connected_since(self, node_id: str) -> float | None:
        """Wall-clock epoch seconds since ``node_id``'s session is ready, or None."""
        session = self.session(node_id)
        return session.connected_since if session is not None else None

    def connected_node_ids(self) -> list[str]:
        """Ids of the nodes with a ready session."""
        return [nid for nid in self._sessions if self.session(nid) is not None]

    async def push_config(self, node_id: str, msg: NodeConfig, *, timeout: float) -> NodeConfigAck:
        """Push ``msg`` to ``node_id`` and wait for its ack (``NodeDispatchError`` otherwise)."""
        session = self.session(node_id)
        if session is None:
            raise NodeDispatchError(f"node {node_id} is not connected")
        return await session.push_config(msg, timeout=timeout)

    # ---------------------------------------------------------------- lifecycle

    async def aclose(self, reason: str) -> None:
        """Shutdown: refuse new nodes, end every session, wait for the handlers to exit."""
        self._closing = reason
        for session in list(self._sessions.values()):
            session._end(reason)
        for channel in list(self._channels):
            await channel.aclose(reason)
        await self._no_handlers.wait()

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one node connection until it ends; never raises (but Cancelled)."""
        peer = _peer_name(stream)
        conn = (
            Connection(Role.EDGE, max_frame_bytes=self.max_frame_bytes)
            if self._on_frames is None
            else _MeteredConnection(
                Role.EDGE, max_frame_bytes=self.max_frame_bytes, on_frames=self._count_frames
            )
        )
        channel = WireChannel(stream, conn, name=peer)
        session: NodeSession | None = None
        self._enter(channel)
        try:
            hello = await self._handshake(channel, peer)
            if hello is None:
                return
            session = NodeSession(self, hello.node_id, channel, peer)
            self._replace(session)
            await session._run(self.heartbeat_interval, self.heartbeat_timeout)
        except ChannelClosed as exc:
            if exc.kind == "protocol":
                self._protocol_error(None, peer, exc.reason, _wire_error_reason(channel))
            else:
                log.info(
                    "event=wire_connection_ended stage=handshake peer=%s reason=%r", peer, exc.reason
                )
        except Exception:
            log.exception("event=wire_connection_failed peer=%s", peer)
        finally:
            with trio.CancelScope(shield=True):
                if session is not None:
                    session._end(session.end_reason or "connection closed")
                    self._leave_session(session)
                await channel.aclose()
                self._leave(channel)

    # ---------------------------------------------------------------- internals

    def _enter(self, channel: WireChannel) -> None:
        if self._handlers == 0:
            self._no_handlers = trio.Event()
        self._handlers += 1
        self._channels.add(channel)

    def _leave(self, channel: WireChannel) -> None:
        self._channels.discard(channel)
        self._handlers -= 1
        if self._handlers == 0:
            self._no_handlers.set()

    async def _handshake(self, channel: WireChannel, peer: str) -> Hello | None:
        with trio.move_on_after(self.handshake_timeout):
            msg = await channel.receive_message()
            assert isinstance(msg, Hello)  # the connection table allows nothing else
            return await self._authenticate(channel, peer, msg)
        log.warning("event=wire_handshake_timeout peer=%s after_s=%g", peer, self.handshake_timeout)
        self.protocol_errors += 1
        if self._on_protocol_error is not None:
            self._call("on_protocol_error", self._on_protocol_error, "handshake_timeout")
        self._wire_error("handshake")
        return None

    async def _authenticate(self, channel: WireChannel, peer: str, hello: Hello) -> Hello | None:
        node_id = hello.node_id
        if self._closing is not None:
            await self._refuse(channel, peer, node_id, "edge is shutting down", "bad_handshake")
            return None
        if hello.protocol_version != PROTOCOL_VERSION:
            await self._refuse(
                channel,
                peer,
                node_id,
                f"protocol version {hello.protocol_version} not supported "
                f"(edge speaks {PROTOCOL_VERSION})",
                "version_mismatch",
            )
            return None
        entry = self._get_nodes().get(node_id)
        if entry is None:
            await self._refuse(channel, peer, node_id, "unknown node id", "unknown_node")
            return None
        presented = hashlib.sha256(hello.token.encode("utf-8", "surrogatepass")).hexdigest()
        if not hmac.compare_digest(presented, entry.token_hash_sha256.lower()):
            await self._refuse(channel, peer, node_id, "invalid node token", "bad_token")
            return None
        ack = HelloAck(
            edge_id=self.edge_id,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
        )
        await channel.send(ack)
        return hello

    async def _refuse(
        self, channel: WireChannel, peer: str, node_id: str, reason: str, code: RefuseCode
    ) -> None:
        log.warning(
            "event=node_refused node=%s peer=%s code=%s reason=%r",
            _printable(node_id),
            peer,
            code,
            reason,
        )
        if self._closing is None:
            self._wire_error("handshake")
        try:
            await channel.send(Refused(reason=reason, code=code))
        except ChannelClosed:
            pass

    def _replace(self, session: NodeSession) -> None:
        old = self._sessions.get(session.node_id)
        if old is not None:
            log.info(
                "event=node_session_replaced node=%s old_peer=%s new_peer=%s",
                session.node_id,
                old.peer,
                session.peer,
            )
            old._end(f"replaced by a new connection from {session.peer}")
            self._leave_session(old)
        self._sessions[session.node_id] = session

    def _leave_session(self, session: NodeSession) -> None:
        """The session is over: unregister it and announce the disconnect once."""
        if self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
        if session.announced:
            session.announced = False
            log.info(
                "event=node_disconnected node=%s peer=%s reason=%r",
                session.node_id,
                session.peer,
                session.end_reason,
            )
            self._call("on_disconnect", self._on_disconnect, session.node_id)

    def _protocol_error(
        self, node_id: str | None, peer: str, reason: str, kind: str = "protocol"
    ) -> None:
        self.protocol_errors += 1
        log.warning("event=wire_protocol_error node=%s peer=%s reason=%r", node_id, peer, reason)
        if self._on_protocol_error is not None:
            self._call("on_protocol_error", self._on_protocol_error, reason)
        self._wire_error(kind)

    def _wire_error(self, reason: str) -> None:
        if self._on_wire_error is not None:
            self._call("on_wire_error", self._on_wire_error, reason)

    def _count_frames(self, direction: str, n: int) -> None:
        if self._on_frames is not None:
            self._call("on_frames", self._on_frames, direction, n)

    def _call(self, what: str, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("event=callback_failed component=nodehub callback=%s", what)


__all__ = ["NodeHub", "NodeSession", "safe_node_reason"]
