"""What a node stream sends: its output frames, from the adapter to the edge.

``LinkSender`` sends one stream's frames on its link, as credit allows.
``WireStream`` is one stream in flight (its cancel scope, how it was told
to stop, and the sender of its link).  ``WireRunOutput`` turns a normalized
run's output into ``RunEvent``s; ``WireTunnelOutput`` turns a passthrough's
head and body into ``ProviderTunnelFrame``s, keeping a whole (not
streamed) reply to send as one ``whole`` frame with the terminal.  The
executor (``iopd.node.executor``) owns the terminal messages.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import trio

from iopd.json_types import JSONObject
from iopd.node.adapters.base import RunOutput, TunnelOutput
from iopd.node.handler import StreamSender
from iopd.transport.channel import ChannelClosed, WireChannel
from wire.connection import StreamState
from wire.errors import LocalProtocolError
from wire.messages import ProviderTunnelFrame, RunEvent, Usage, is_terminal

#: A non-streamed body is held back (to leave with the terminal in one write)
#: up to this many bytes; beyond, it is written as it arrives.
MAX_HELD_BODY_BYTES = 256 * 1024
#: Content types relayed piece by piece (never held).
_STREAMED_TYPES = ("text/event-stream", "application/x-ndjson")


@dataclass
class WireStream:
    """One stream in flight: its cancel scope and how it is being told to stop."""

    stream_id: int
    sender: StreamSender
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    cancel_reason: str | None = None
    link_gone: bool = False

    def __post_init__(self) -> None:
        # ``send_held`` (the node link's sender has it) lets a frame that another
        # follows at once leave in the same write: fewer syscalls and wakeups.
        # Looked up once per stream, not per frame.
        self._send_held: Callable[[RunEvent | ProviderTunnelFrame], Awaitable[None]] = getattr(
            self.sender, "send_held", self.sender.send
        )
        # ``send_soon``: a frame may leave at the end of the scheduler round,
        # in one write with the other streams' frames of that round.
        self._send_soon: Callable[[RunEvent | ProviderTunnelFrame], Awaitable[None]] = getattr(
            self.sender, "send_soon", self.sender.send
        )
        # A whole reply leaves as one frame: its body is kept up to a quarter
        # of the link's frame cap (headers and usage fit in the rest).
        frame_cap = getattr(self.sender, "max_frame_bytes", 0)
        self.whole_limit = MAX_HELD_BODY_BYTES
        if frame_cap:
            self.whole_limit = min(MAX_HELD_BODY_BYTES, frame_cap // 4)

    async def send(self, msg: RunEvent | ProviderTunnelFrame, *, hold: bool = False) -> None:
        """Send an output message; a broken link ends the stream's work.

        ``hold=True``: the caller sends another frame right after this one.
        """
        try:
            await (self._send_held if hold else self._send_soon)(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.link_gone = True
            self.scope.cancel()
            await trio.lowlevel.checkpoint()  # raises Cancelled for our own scope
            raise  # pragma: no cover - unreachable: the scope is cancelled

    async def send_terminal(self, *msgs: RunEvent | ProviderTunnelFrame) -> None:
        """Send the closing messages (in one write); a broken link is not an error here."""
        if self.link_gone:
            return
        try:
            last = len(msgs) - 1
            for i, msg in enumerate(msgs):
                await (self._send_held if i < last else self.sender.send)(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.link_gone = True


class WireRunOutput(RunOutput):
    def __init__(self, stream: WireStream) -> None:
        super().__init__()
        self._stream = stream

    async def text(self, delta: str) -> None:
        await self._stream.send(RunEvent(stream_id=self._stream.stream_id, kind="text", text=delta))

    async def reasoning(self, delta: str) -> None:
        await self._stream.send(
            RunEvent(stream_id=self._stream.stream_id, kind="reasoning", text=delta)
        )

    async def tool_call(self, call: JSONObject) -> None:
        await self._stream.send(
            RunEvent(stream_id=self._stream.stream_id, kind="tool_call", tool_call=call)
        )


class WireTunnelOutput(TunnelOutput):
    """Turns the adapter's head and body into tunnel frames.

    A whole (not streamed) reply is kept here, head and body, up to
    ``whole_limit`` bytes of body: when the adapter is done, the executor
    sends it as one ``whole`` frame with the usage, the stream's terminal
    (one frame to build, encode, decode and dispatch instead of four).  A
    body that outgrows the limit, or a failure, lets the kept head and
    body go first as a ``head`` and a ``body`` frame (``kept_frames``).
    The body is kept in one buffer, however many pieces it came in.
    """

    def __init__(self, stream: WireStream, whole_limit: int = MAX_HELD_BODY_BYTES) -> None:
        super().__init__()
        self._stream = stream
        self.head_sent = False  # the adapter gave the head (sent, or kept for ``whole``)
        self._hold = False
        self._held_bytes = 0
        self._whole_limit = whole_limit
        #: The kept head of a whole reply (status, headers), and its body so far.
        self.kept: tuple[int, list[tuple[str, str]]] | None = None
        self._kept_body: bytes | bytearray = b""

    async def head(
        self, status: int, headers: list[tuple[str, str]], *, body_follows: bool = False
    ) -> None:
        self.head_sent = True
        # A whole (not streamed) body follows at once: keep the head and the
        # body so that they leave with the terminal as one frame.  SSE and
        # NDJSON are written piece by piece as they arrive.
        self._hold = not any(
            k.lower() == "content-type" and v.lower().startswith(_STREAMED_TYPES)
            for k, v in headers
        )
        if self._hold:
            self.kept = (status, headers)
            return
        await self._stream.send(
            ProviderTunnelFrame(
                stream_id=self._stream.stream_id, kind="head", status=status, headers=headers
            ),
            # Held when the first body bytes are already here: one write, and
            # the edge writes the caller's head with the first chunk.
            hold=body_follows,
        )

    async def body(self, data: bytes) -> None:
        if not data:
            return
        if self.kept is not None:
            if self._held_bytes + len(data) <= self._whole_limit:
                self._held_bytes += len(data)
                if not self._kept_body:
                    self._kept_body = data  # the usual case: one piece, no copy
                else:
                    if isinstance(self._kept_body, bytes):
                        self._kept_body = bytearray(self._kept_body)
                    self._kept_body += data
                return
            for frame in self.kept_frames():  # outgrown: they go ahead of this piece
                await self._stream.send(frame, hold=True)
        self._held_bytes += len(data)
        hold = self._hold and self._held_bytes <= MAX_HELD_BODY_BYTES
        if not hold:
            self._held_bytes = 0
        await self._stream.send(
            ProviderTunnelFrame(stream_id=self._stream.stream_id, kind="body", data=data),
            hold=hold,
        )

    def kept_frames(self) -> list[ProviderTunnelFrame]:
        """The kept head and body as frames (none if nothing is kept); the
        reply is no longer kept."""
        kept, body = self.kept, self._kept_body
        if kept is None:
            return []
        self.kept, self._kept_body = None, b""
        sid = self._stream.stream_id
        frames = [ProviderTunnelFrame(stream_id=sid, kind="head", status=kept[0], headers=kept[1])]
        if body:
            frames.append(ProviderTunnelFrame(stream_id=sid, kind="body", data=bytes(body)))
        return frames

    def whole(self, usage: Usage | None) -> ProviderTunnelFrame:
        """The kept reply as one terminal ``whole`` frame, with ``usage``."""
        assert self.kept is not None
        status, headers = self.kept
        return ProviderTunnelFrame(
            stream_id=self._stream.stream_id,
            kind="whole",
            status=status,
            headers=headers,
            data=bytes(self._kept_body),
            body_usage=usage,
            reasoning_chars=self.reasoning_chars,
        )


class LinkSender:
    """``iopd.node.handler.StreamSender`` for one stream of a link: credit-aware sends.

    The node's link makes one per stream it admits; the frames go out on the
    link's ``WireChannel``, each waiting while the stream's credit is spent
    (the terminal never waits, so a stream can always end).
    """

    def __init__(
        self,
        channel: WireChannel,
        stream_id: int,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._channel = channel
        self.stream_id = stream_id
        self._credit_changed = trio.Event()
        self._release = release  # gives the stream's node slot back (once)

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame the link sends (a whole reply must fit in one)."""
        return self._channel.conn.max_frame_bytes

    def release_slot(self) -> None:
        """Give the stream's slot back now (idempotent)."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def credit_arrived(self) -> None:
        self._credit_changed.set()
        self._credit_changed = trio.Event()

    async def send(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        """Send one reply; waits while the window is exhausted (the terminal never waits).

        Raises ``trio.BrokenResourceError`` (``ChannelClosed``) when the link is
        gone and ``trio.ClosedResourceError`` when the stream already ended.
        """
        if msg.stream_id != self.stream_id:
            msg = msgspec.structs.replace(msg, stream_id=self.stream_id)
        conn = self._channel.conn
        terminal = is_terminal(msg)
        while not terminal and conn.stream_credit(self.stream_id) <= 0:
            if self._channel.closed:
                raise ChannelClosed(self._channel.close_reason or "link closed", "closed")
            if conn.stream_state(self.stream_id) not in (StreamState.OPEN, StreamState.CANCELLED):
                raise trio.ClosedResourceError(f"stream {self.stream_id} already ended")
            # Held frames must reach the edge before it can return their credit.
            await self._channel.flush()
            await self._credit_changed.wait()
        if terminal and self._release is not None:
            self.release_slot()  # before the edge can read the terminal and open anew
        try:
            await self._channel.send(msg)
        except LocalProtocolError as exc:
            raise trio.ClosedResourceError(exc.reason) from None

    def _may_wait(self, msg: RunEvent | ProviderTunnelFrame) -> bool:
        """Whether ``msg`` may leave later than now: not a terminal, and credit left."""
        return not is_terminal(msg) and self._channel.conn.stream_credit(self.stream_id) > 0

    async def send_soon(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        """Like ``send``, but the frame may leave at the end of the scheduler
        round, in one write with what the other streams sent in that round
        (``WireChannel.send_soon``).  The terminal is sent at once."""
        if msg.stream_id != self.stream_id or not self._may_wait(msg):
            await self.send(msg)
            return
        try:
            await self._channel.send_soon(msg)
        except LocalProtocolError as exc:
            raise trio.ClosedResourceError(exc.reason) from None

    async def send_held(self, msg: RunEvent | ProviderTunnelFrame) -> None:
        """Like ``send``, but the frame may wait for the stream's next send to
        leave in the same write.  Only for a frame that another follows at once."""
        if msg.stream_id != self.stream_id or not self._may_wait(msg):
            await self.send(msg)
            return
        try:
            self._channel.queue(msg)
        except LocalProtocolError as exc:
            raise trio.ClosedResourceError(exc.reason) from None
        # A cancel point but no trip through the scheduler: the send that
        # follows at once yields anyway (a full checkpoint here cost one
        # scheduler round per held frame, three per non-streamed reply).
        await trio.lowlevel.checkpoint_if_cancelled()
