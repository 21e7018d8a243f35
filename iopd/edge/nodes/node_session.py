"""``NodeSession``: the edge's live session with one node, and the streams opened on it.

Why it looks like this:

* A session is a wire channel and the streams open on it; the request path
  uses ``open_stream`` and nothing else.  ``NodeHub`` (``iopd/edge/nodes/hub.py``)
  builds it after the handshake, feeds it the node's replies (``deliver``),
  announces it (``mark_ready``) and ends it (``mark_ended``, then ``close``).
  The session never calls back into the hub: the dependency runs one way.
* Streams are typed by what they carry: ``open_stream(RunRequest)`` yields a
  ``RunStream`` (``RunEvent``s), ``open_stream(ProviderTunnelRequest)`` a
  ``TunnelStream`` (``ProviderTunnelFrame``s).  The wire's state table
  already rejects a reply of the wrong kind for its stream, so the type holds.
* A consumer that only copies replies out (the passthrough relay: head,
  body, end) may give its stream a ``DirectWriter``: while the consumer
  is parked with nothing buffered, the reader offers each reply to it; one
  it takes is consumed there and then (its bytes held), and at the end of
  the reader's batch (``flush_direct``: whatever the read brought in) the
  writer writes what it holds to the caller's socket without awaiting.  A
  streamed chunk, or a whole non-streaming reply, then crosses the edge in
  the reader's task step instead of waking the handler to write it.
  Anything it declines is buffered and the consumer woken, as without it.
  A consumer that is cancelled stops being parked at once (its wait is
  aborted), so nothing is written for a request past its deadline.
* The hub's reader hands each reply to its stream's buffer without ever
  blocking (``window`` frames + the terminal; the wire's credit accounting
  guarantees it fits — a node that sends past its window is a protocol
  error).  The consumer returns ``Credit`` as it reads.  When the session
  dies every stream still waiting for its terminal raises
  ``NodeDispatchError`` at its next read, even with frames still buffered (a
  stream that has its terminal is complete and is read to the end).  Leaving
  ``open_stream`` before the terminal sends ``Cancel`` (queued, never
  blocking the caller) and refunds the credit of unread frames; late replies
  of abandoned streams are credited and dropped.
* A node that does not admit a stream answers ``Busy`` (``deliver_busy``):
  the stream ends with an ``error`` of code ``node_busy`` of its own kind,
  so every path handles it where it handles a failure before any output.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Final, Generic, Protocol, TypeVar, cast, overload

import msgspec
import trio

from iopd.errors import NodeDispatchError
from iopd.transport.channel import ChannelClosed, WireChannel
from wire.connection import StreamState
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.messages import (
    Busy,
    Cancel,
    ControlUpdate,
    Credit,
    ErrorCode,
    Message,
    NodeConfig,
    NodeConfigAck,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    is_terminal,
)

__all__ = ["NODE_BUSY", "DirectWriter", "NodeSession", "NodeStream", "Reply", "RunStream", "TunnelStream"]

#: The error code a stream ends with when its node answered ``Busy``.
NODE_BUSY: Final[ErrorCode] = "node_busy"

Reply = RunEvent | ProviderTunnelFrame | NodeConfigAck
"""What a node sends on a stream the edge opened."""

R_co = TypeVar("R_co", bound=Reply, covariant=True)
R_contra = TypeVar("R_contra", bound=Reply, contravariant=True)


class DirectWriter(Protocol[R_contra]):
    """Writes replies out from the hub's reader, for a parked consumer.

    ``write_now`` and ``flush_now`` run in the reader (synchronous, never
    blocking, never raising).  ``write_now``: True when the writer took the
    reply (it counts as consumed), False to have it buffered for the
    consumer (it may still have held bytes for it, e.g. a response's end).
    ``flush_now``, at the end of a batch in which the writer was offered
    a reply: write what it holds.  When that left anything unwritten,
    ``pending`` is True until the consumer's ``settle`` (awaited before the
    consumer looks at its buffer again) writes the rest.
    """

    @property
    def pending(self) -> bool: ...

    def write_now(self, msg: R_contra) -> bool: ...

    def flush_now(self) -> None: ...

    async def settle(self) -> None: ...


class NodeStream(Generic[R_co]):
    """One open stream as its consumer sees it: an async iterator of the node's replies.

    The buffer is a plain deque: the hub's reader appends (never blocks), the
    consumer pops.  It holds at most ``window`` non-terminal frames plus the
    terminal, because the connection's credit check rejects anything more.
    """

    def __init__(
        self,
        node_id: str,
        stream_id: int,
        window: int,
        post: Callable[[Message], None],
        *,
        tunnel: bool = False,
    ) -> None:
        self.node_id = node_id
        self.stream_id = stream_id
        self.tunnel = tunnel  # carries ProviderTunnelFrames (else RunEvents)
        self.window = window
        self._post = post  # queue a message to the node, never blocking
        self._buf: deque[R_co] = deque()
        self._parked: trio.lowlevel.Task | None = None  # the consumer, waiting for a reply
        self._done = False  # no more deliveries (terminal, failure or abandoned)
        self._credit_batch = max(1, window // 4)
        self._unreported = 0  # consumed frames whose credit was not returned yet
        self.terminal_received = False  # by the reader
        self.terminal_consumed = False  # by the consumer
        self.error: NodeDispatchError | None = None
        #: Set by the consumer: replies written from the reader while it is parked.
        self.direct: DirectWriter[R_co] | None = None
        self._flush_due = False  # the writer was offered a reply in the reader's batch

    def buffered(self) -> int:
        """Replies that arrived and were not read yet (0: the next read may wait)."""
        return len(self._buf)

    # -- the consumer's side

    def __aiter__(self) -> NodeStream[R_co]:
        return self

    async def __anext__(self) -> R_co:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self.error is not None:  # even with frames buffered: fail at once
                raise self.error
            if self.terminal_consumed:
                raise StopAsyncIteration
            if self._buf:
                break
            if self._done:
                raise NodeDispatchError(f"node {self.node_id} disconnected")
            self._parked = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._unpark)
            direct = self.direct
            if direct is not None and direct.pending:
                await direct.settle()
        msg = self._buf.popleft()
        if is_terminal(msg):
            self.terminal_consumed = True
        else:
            self._consumed()
        return msg

    def _unpark(self, _: object) -> trio.lowlevel.Abort:
        """The parked consumer was cancelled: it is no longer parked."""
        self._parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _consumed(self) -> None:
        """One non-terminal reply consumed: its credit goes back in batches."""
        self._unreported += 1
        if self._unreported >= self._credit_batch:
            self._post(Credit(stream_id=self.stream_id, frames=self._unreported))
            self._unreported = 0

    # -- the session's side (sync, never blocks)

    def deliver(self, msg: Reply) -> bool:
        """Buffer one reply, or give it to the direct writer; True when the
        writer was offered it (call ``flush_direct`` at the end of the batch).

        A node that overruns the window broke the protocol.
        """
        if self._done or len(self._buf) > self.window:
            raise RemoteProtocolError(f"node overran the buffer of stream {self.stream_id}")
        # The wire's state table admits only this stream's kind of reply.
        reply = cast(R_co, msg)
        direct = self.direct
        offered = False
        # The writer may run here only when the consumer cannot be writing:
        # parked (so inside no await of its own), nothing buffered (so this
        # reply is the next one in order) and nothing of an earlier flush left
        # unsent (so its bytes go out after those).  Once a reply is buffered
        # the consumer is woken and no longer parked: the rest of the batch is
        # buffered behind it.
        if (
            direct is not None
            and self._parked is not None  # nothing of the consumer's in flight
            and not self._buf
            and not direct.pending
        ):
            offered = not self._flush_due
            self._flush_due = True
            if direct.write_now(reply):
                self._consumed()  # (a DirectWriter never takes the terminal)
                return offered
        self._buf.append(reply)
        if is_terminal(msg):
            self.terminal_received = True
            self._done = True
        self._wake()
        return offered

    def flush_direct(self) -> None:
        """The reader's batch is over: the direct writer writes what it holds
        (the consumer has not run since it was offered the replies)."""
        if not self._flush_due:
            return
        self._flush_due = False
        direct = self.direct
        if direct is None:
            return
        direct.flush_now()
        if direct.pending:
            self._wake()  # the consumer writes the rest
    def fail(self, error: NodeDispatchError) -> None:
        if self.error is None:
            self.error = error
        self._done = True
        self._wake()

    def abandon(self) -> int:
        """The consumer left: frames whose credit the node should get back."""
        refund = self._unreported + sum(1 for m in self._buf if not is_terminal(m))
        self._unreported = 0
        self._buf.clear()
        self._done = True
        self.direct = None
        return refund

    def _wake(self) -> None:
        task = self._parked
        if task is not None:
            self._parked = None
            trio.lowlevel.reschedule(task)


RunStream = NodeStream[RunEvent]
"""The stream of a ``RunRequest`` (normalized path): ``RunEvent``s up to the terminal."""
TunnelStream = NodeStream[ProviderTunnelFrame]
"""The stream of a ``ProviderTunnelRequest`` (passthrough): frames up to the terminal."""


class NodeSession:
    """The edge's live session with one node.  Obtain it from ``NodeHub.session``."""

    def __init__(
        self, node_id: str, channel: WireChannel, peer: str, features: frozenset[str] = frozenset()
    ) -> None:
        self.node_id = node_id
        self.peer = peer
        #: What the node said it understands (``Hello.features``).
        self.features = features
        self.session_id = secrets.token_hex(8)
        self._channel = channel
        self._streams: dict[int, NodeStream[Reply]] = {}
        self._flush_due: list[NodeStream[Reply]] = []  # direct writers to flush after a batch
        self._next_stream_id = 0
        #: Wall-clock epoch seconds since the node acknowledged its first config.
        self.connected_since: float | None = None
        self.end_reason: str | None = None
        #: ``ProviderStatus`` entries that named no provider of this node (ignored).
        self.status_ignored = 0
        #: Set by ``retire``: the node left the config; the session takes no new
        #: streams and ends once its open ones are done.
        self.retire_reason: str | None = None
        self._retired = trio.Event()
        self._idle: trio.Event | None = None

    @property
    def alive(self) -> bool:
        return self.end_reason is None

    @property
    def ready(self) -> bool:
        """The node acknowledged its first ``NodeConfig`` (the hub announced it)."""
        return self.connected_since is not None

    # ---------------------------------------------------------------- streams

    @overload
    def open_stream(self, req: RunRequest) -> AbstractAsyncContextManager[RunStream]: ...

    @overload
    def open_stream(
        self, req: ProviderTunnelRequest
    ) -> AbstractAsyncContextManager[TunnelStream]: ...

    def open_stream(
        self, req: RunRequest | ProviderTunnelRequest
    ) -> AbstractAsyncContextManager[NodeStream[Reply]]:
        """Send ``req`` on a fresh stream; yield the stream of its replies.

        The stream ends after the terminal reply.  It raises
        ``NodeDispatchError("node <id> disconnected")`` as soon as the session
        is lost.  Leaving the block before the terminal sends ``Cancel``.
        ``req.stream_id`` is assigned here.
        """
        return self._open(req, req.window)

    async def push_config(self, msg: NodeConfig, *, timeout: float) -> NodeConfigAck:
        """Send ``msg`` (its stream id is replaced) and wait for the node's ack.

        Raises ``NodeDispatchError`` when the node is lost or does not answer
        within ``timeout`` seconds.
        """
        with trio.move_on_after(timeout):
            async with self._open(msg, 1) as replies:
                async for reply in replies:
                    if isinstance(reply, NodeConfigAck):
                        return reply
            raise NodeDispatchError(f"node {self.node_id} ended the config stream without an ack")
        raise NodeDispatchError(
            f"node {self.node_id} did not acknowledge config version {msg.version} "
            f"within {timeout:g}s"
        )

    def send_controls(self, msg: ControlUpdate) -> None:
        """Queue an operator's control change for the node (never blocks).

        Raises ``NodeDispatchError`` once the session has ended.
        """
        if not self.alive or self._channel.closed:
            raise NodeDispatchError(f"node {self.node_id} disconnected")
        self._channel.post(msg)

    def _open(
        self, req: RunRequest | ProviderTunnelRequest | NodeConfig, window: int
    ) -> _OpenStream:
        return _OpenStream(self, req, window)

    # ------------------------------------------------- the hub's side (hub.py)

    def deliver(self, msg: Reply) -> None:
        """A reply from the node, from the hub's reader; never blocks.

        Raises ``RemoteProtocolError`` when the node overran a stream's buffer.
        """
        stream = self._streams.get(msg.stream_id)
        if stream is not None:
            if stream.deliver(msg):
                self._flush_due.append(stream)
        elif not is_terminal(msg):
            # Abandoned stream: drop the late reply, give its credit back.
            self._channel.post(Credit(stream_id=msg.stream_id, frames=1))

    def deliver_busy(self, msg: Busy) -> None:
        """The node did not admit the stream: end it with the error ``node_busy``."""
        stream = self._streams.get(msg.stream_id)
        if stream is None:
            return  # abandoned meanwhile; Busy needs no credit back
        text = f"provider {msg.load.provider_id} is busy on node {self.node_id}"
        stream.deliver(
            ProviderTunnelFrame(stream_id=msg.stream_id, kind="error", code=NODE_BUSY, message=text)
            if stream.tunnel
            else RunEvent(stream_id=msg.stream_id, kind="error", code=NODE_BUSY, message=text)
        )

    def post(self, msg: Message) -> None:
        """Queue a session message for the node (never blocks; dropped once closed)."""
        self._channel.post(msg)

    def end_of_batch(self) -> None:
        """The hub's reader handled everything one read brought in: the direct
        writers it fed write what they hold (one write per stream per read)."""
        due = self._flush_due
        if due:
            self._flush_due = []
            for stream in due:
                stream.flush_direct()

    def mark_ready(self) -> None:
        """The node acknowledged its first config: the session may be used."""
        self.connected_since = time.time()

    def retire(self, reason: str) -> None:
        """Take no new streams; ``retired_and_idle`` returns once the open ones are done."""
        if self.retire_reason is None:
            self.retire_reason = reason
            self._retired.set()

    async def retired_and_idle(self) -> str:
        """Wait until the session is retired and has no open stream; the reason."""
        await self._retired.wait()
        while self._streams:
            self._idle = trio.Event()
            await self._idle.wait()
        return self.retire_reason or "retired"

    def mark_ended(self, reason: str) -> bool:
        """Refuse new streams from now on; False when the session had ended already."""
        if self.end_reason is not None:
            return False
        self.end_reason = reason
        return True

    def close(self) -> None:
        """Fail every stream still waiting for its terminal; close the channel (sync)."""
        error = NodeDispatchError(f"node {self.node_id} disconnected")
        for stream in list(self._streams.values()):
            if not stream.terminal_received:  # a finished stream keeps its replies
                stream.fail(error)
        self._channel.close_soon(self.end_reason or "session ended")


class _OpenStream:
    """``NodeSession.open_stream`` (a class: no generator frame on the hot path).

    Entering sends the request on a fresh stream and gives its replies;
    leaving (also when the send failed) forgets the stream and, before its
    terminal, sends ``Cancel`` and gives the credit of unread replies back.
    """

    __slots__ = ("_session", "_req", "_window", "_stream")

    def __init__(
        self,
        session: NodeSession,
        req: RunRequest | ProviderTunnelRequest | NodeConfig,
        window: int,
    ) -> None:
        self._session = session
        self._req = req
        self._window = window
        self._stream: NodeStream[Reply] | None = None

    async def __aenter__(self) -> NodeStream[Reply]:
        session, req = self._session, self._req
        if self._stream is not None:
            raise RuntimeError("a node stream is opened once")
        if not session.alive or session.retire_reason is not None:
            raise NodeDispatchError(f"node {session.node_id} disconnected")
        # Ids go out in increasing order without a lock: the channel encodes
        # (and checks) each frame synchronously, in call order.
        session._next_stream_id += 1
        stream_id = session._next_stream_id
        channel = session._channel
        stream: NodeStream[Reply] = NodeStream(
            session.node_id,
            stream_id,
            self._window,
            channel.post,
            tunnel=isinstance(req, ProviderTunnelRequest),
        )
        session._streams[stream_id] = stream
        self._stream = stream
        try:
            try:
                await channel.send(msgspec.structs.replace(req, stream_id=stream_id))
            except ChannelClosed:
                raise NodeDispatchError(f"node {session.node_id} disconnected") from None
            except LocalProtocolError as exc:
                raise NodeDispatchError(
                    f"cannot send the request to node {session.node_id}: {exc.reason}"
                ) from None
        except BaseException:
            self._leave()
            raise
        return stream

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    def _leave(self) -> None:
        session, stream = self._session, self._stream
        assert stream is not None
        stream_id = stream.stream_id
        session._streams.pop(stream_id, None)
        if session._idle is not None and not session._streams:
            session._idle.set()
        refund = stream.abandon()
        opened = session._channel.conn.stream_state(stream_id) is not StreamState.IDLE
        if session.alive and opened and not stream.terminal_received:
            session._channel.post(Cancel(stream_id=stream_id, reason="edge abandoned the stream"))
            if refund:
                session._channel.post(Credit(stream_id=stream_id, frames=refund))
