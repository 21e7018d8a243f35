"""The sans-IO connection state machine of the Edge-Node wire (both roles).

Why a table: every legal move is written down once, as data, in
``CONNECTION_TRANSITIONS`` (handshake and session) and ``STREAM_TRANSITIONS``
(one multiplexed stream), and ``Connection._apply`` is the only place that
changes state.  ``send`` checks *our* moves (``LocalProtocolError``: a bug on
our side, nothing is sent), ``receive_data`` checks the *peer's* moves
(``RemoteProtocolError``: close that connection).  Both sides run the same
machine, so each knows exactly what the other may do next.

Handshake (SCRAM-SHA-256, ``wire.scram``): the node sends ``Hello`` first;
the edge answers ``Challenge`` or ``Refused`` (closed); the node sends its
``Proof``; the edge answers ``HelloAck`` (the session is open) or ``Refused``.
Nothing else may cross before that, and no frame of more than
``handshake_max_frame_bytes`` (a few KiB, ``wire.framing``) either way: the
session's ``max_frame_bytes`` applies once ``HelloAck`` has crossed, from the
very next frame (even one that arrived in the same read).

Streams: only the edge opens streams (``RunRequest``, ``ProviderTunnelRequest``,
``NodeConfig``), with strictly increasing ``stream_id`` (so "closed" needs no
memory: an id at or below the highest opened one that is not open is closed).
The node replies only on open streams, with the reply type of the stream, and
ends each with exactly one terminal message (``wire.messages.is_terminal``);
``Busy`` (the node did not admit it) is a terminal reply to a run or a tunnel.
Session messages of admission: ``LoadReport`` (node) and ``Waiting`` (edge).
``Cancel`` and ``Credit`` on a stream that already ended are legal and ignored
(they race the terminal).  Credit: a request's ``window`` is how many
non-terminal replies the node may send; ``Credit(frames)`` adds to it.  The
terminal reply needs no credit, so a node can always finish a stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from wire.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    VersionMismatch,
    WireError,
)
from wire.framing import HANDSHAKE_MAX_FRAME_BYTES, MAX_FRAME_BYTES, FrameDecoder, encode_frame
from wire.messages import (
    PROTOCOL_VERSION,
    Busy,
    Cancel,
    Challenge,
    ControlState,
    ControlUpdate,
    Credit,
    GoAway,
    Heartbeat,
    Hello,
    HelloAck,
    LoadReport,
    Message,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    Pong,
    Proof,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
    RunRequest,
    Waiting,
    is_terminal,
)


class _FastHashEnum(enum.Enum):
    """An Enum hashed by identity.

    ``enum.Enum.__hash__`` is Python code (it hashes the member's name), and
    the transition tables below look members up several times per message.
    Members are singletons compared by identity, so the identity hash is
    equivalent and runs in C.
    """

    __hash__ = object.__hash__


class Role(_FastHashEnum):
    """Which end of the wire a ``Connection`` plays."""

    EDGE = "edge"
    NODE = "node"

    @property
    def peer(self) -> Role:
        return Role.NODE if self is Role.EDGE else Role.EDGE


class ConnState(_FastHashEnum):
    """State of the whole connection (shared by both ends)."""

    AWAIT_HELLO = "await_hello"  # nothing has crossed yet; the node must send Hello
    HELLO_SENT = "hello_sent"  # the edge must answer Challenge or Refused
    CHALLENGED = "challenged"  # the node must send its Proof
    PROOF_SENT = "proof_sent"  # the edge must answer HelloAck or Refused
    OPEN = "open"  # session established: streams, status, heartbeats
    CLOSED = "closed"  # refused, closed, or broken by a protocol error


class StreamState(_FastHashEnum):
    """State of one stream id."""

    IDLE = "idle"  # never opened (id above the highest opened one)
    OPEN = "open"
    CANCELLED = "cancelled"  # the edge sent Cancel; replies may still arrive until the terminal
    CLOSED = "closed"  # the terminal crossed


class StreamEvent(_FastHashEnum):
    """What a message does to its stream."""

    OPEN = "open"
    REPLY = "reply"
    TERMINAL = "terminal"
    CANCEL = "cancel"
    CREDIT = "credit"


_EDGE = Role.EDGE
_NODE = Role.NODE
_OPEN = ConnState.OPEN

_EDGE_SESSION_MESSAGES: tuple[type[Message], ...] = (
    Heartbeat,
    Pong,
    NodeConfig,
    RunRequest,
    ProviderTunnelRequest,
    Cancel,
    Credit,
    Waiting,
    ControlUpdate,
    GoAway,
)
_NODE_SESSION_MESSAGES: tuple[type[Message], ...] = (
    Heartbeat,
    Pong,
    ProviderStatus,
    NodeConfigAck,
    RunEvent,
    ProviderTunnelFrame,
    LoadReport,
    Busy,
    NodeConfigState,
    ControlState,
)

#: state -> (sender, message type) -> next state.  Anything absent is illegal.
CONNECTION_TRANSITIONS: dict[ConnState, dict[tuple[Role, type[Message]], ConnState]] = {
    ConnState.AWAIT_HELLO: {(_NODE, Hello): ConnState.HELLO_SENT},
    ConnState.HELLO_SENT: {
        (_EDGE, Challenge): ConnState.CHALLENGED,
        (_EDGE, Refused): ConnState.CLOSED,
    },
    ConnState.CHALLENGED: {(_NODE, Proof): ConnState.PROOF_SENT},
    ConnState.PROOF_SENT: {
        (_EDGE, HelloAck): ConnState.OPEN,
        (_EDGE, Refused): ConnState.CLOSED,
    },
    ConnState.OPEN: {
        **{(_EDGE, t): ConnState.OPEN for t in _EDGE_SESSION_MESSAGES},
        **{(_NODE, t): ConnState.OPEN for t in _NODE_SESSION_MESSAGES},
    },
    ConnState.CLOSED: {},
}

#: stream state -> event -> next stream state.  Anything absent is illegal.
STREAM_TRANSITIONS: dict[StreamState, dict[StreamEvent, StreamState]] = {
    StreamState.IDLE: {StreamEvent.OPEN: StreamState.OPEN},
    StreamState.OPEN: {
        StreamEvent.REPLY: StreamState.OPEN,
        StreamEvent.TERMINAL: StreamState.CLOSED,
        StreamEvent.CANCEL: StreamState.CANCELLED,
        StreamEvent.CREDIT: StreamState.OPEN,
    },
    StreamState.CANCELLED: {
        StreamEvent.REPLY: StreamState.CANCELLED,
        StreamEvent.TERMINAL: StreamState.CLOSED,
        StreamEvent.CANCEL: StreamState.CANCELLED,
        StreamEvent.CREDIT: StreamState.CANCELLED,
    },
    StreamState.CLOSED: {
        # Cancel and Credit race the terminal: legal, ignored.
        StreamEvent.CANCEL: StreamState.CLOSED,
        StreamEvent.CREDIT: StreamState.CLOSED,
    },
}

_OPENERS: dict[type[Message], str] = {
    RunRequest: "run",
    ProviderTunnelRequest: "tunnel",
    NodeConfig: "config",
}
#: reply type -> the kinds of stream it may answer.
_REPLIES: dict[type[Message], frozenset[str]] = {
    RunEvent: frozenset({"run"}),
    ProviderTunnelFrame: frozenset({"tunnel"}),
    NodeConfigAck: frozenset({"config"}),
    Busy: frozenset({"run", "tunnel"}),  # the node did not admit it (terminal)
}


@dataclass(slots=True)
class StreamInfo:
    """Book-keeping of one open stream."""

    kind: str  # "run" | "tunnel" | "config"
    state: StreamState
    credit: int  # non-terminal replies the node may still send


class _Illegal(Exception):
    """Internal: a move the tables forbid; turned into Local/RemoteProtocolError."""


class Connection:
    """One end of an Edge-Node connection: bytes in, messages out, and the reverse.

    ``send(msg) -> bytes`` checks that *we* may send ``msg`` now, updates the
    state, and returns the frame to write.  ``receive_data(data)`` decodes and
    checks what the peer sent.  No I/O happens here.

    ``max_frame_bytes`` is the session's frame cap; before the session is open
    the cap is ``handshake_max_frame_bytes`` (or ``max_frame_bytes`` if that
    is smaller), so an unauthenticated peer never makes us buffer more.
    """

    def __init__(
        self,
        role: Role,
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        handshake_max_frame_bytes: int = HANDSHAKE_MAX_FRAME_BYTES,
    ) -> None:
        self.our_role = role
        self.their_role = role.peer
        self.max_frame_bytes = max_frame_bytes
        self.handshake_max_frame_bytes = min(handshake_max_frame_bytes, max_frame_bytes)
        self.state = ConnState.AWAIT_HELLO
        self.hello: Hello | None = None  # the node's Hello, once it crossed
        self.hello_ack: HelloAck | None = None
        self.refused: Refused | None = None
        self._decoder = FrameDecoder(self.handshake_max_frame_bytes)
        self._streams: dict[int, StreamInfo] = {}
        self._last_stream_id = 0
        self._error: RemoteProtocolError | None = None

    # ------------------------------------------------------------ queries

    def stream_state(self, stream_id: int) -> StreamState:
        """The state of ``stream_id`` as this end sees it."""
        info = self._streams.get(stream_id)
        if info is not None:
            return info.state
        return StreamState.CLOSED if 0 < stream_id <= self._last_stream_id else StreamState.IDLE

    def stream_credit(self, stream_id: int) -> int:
        """Non-terminal replies the node may still send on ``stream_id`` (0 if not open)."""
        info = self._streams.get(stream_id)
        return info.credit if info is not None else 0

    @property
    def frame_limit(self) -> int:
        """The cap of one frame's body now (the handshake's until the session is open)."""
        return self._decoder.max_frame_bytes

    @property
    def open_stream_ids(self) -> list[int]:
        """Ids of the streams that have not seen their terminal yet."""
        return list(self._streams)

    @property
    def open_stream_count(self) -> int:
        """How many streams have not seen their terminal yet."""
        return len(self._streams)

    @property
    def last_stream_id(self) -> int:
        """The highest stream id opened so far (0 before the first)."""
        return self._last_stream_id

    # ------------------------------------------------------------ events

    def send(self, msg: Message) -> bytes:
        """Check and record that we send ``msg``; return its frame bytes.

        Raises ``LocalProtocolError`` (and changes nothing) when ``msg`` is not
        legal now, or when it is too large for one frame.
        """
        if self.our_role is Role.EDGE and isinstance(msg, Challenge | HelloAck):
            if self.hello is not None and self.hello.protocol_version != PROTOCOL_VERSION:
                raise LocalProtocolError(
                    f"cannot accept protocol version {self.hello.protocol_version}: send Refused"
                )
        data = encode_frame(msg, max_frame_bytes=self._decoder.max_frame_bytes)
        try:
            self._apply(self.our_role, msg)
        except _Illegal as exc:
            raise LocalProtocolError(str(exc)) from None
        return data

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Feed bytes from the peer; return the messages they complete, in order.

        Raises a ``RemoteProtocolError`` subclass when the peer broke the
        protocol; the connection is then closed and every later call raises it
        again.
        """
        if self._error is not None:
            raise self._error
        try:
            if self.state is _OPEN:
                msgs = self._decoder.feed(data)
                self._apply_received(msgs)
            else:
                msgs = self._receive_handshake(data)
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise
        return msgs

    def _receive_handshake(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """``receive_data`` before the session is open: one message at a time,
        because the frame cap grows the moment ``HelloAck`` is applied."""
        decoder = self._decoder
        out: list[Message] = []
        msgs = decoder.feed(data, max_messages=1)
        while msgs:
            msg = msgs[0]
            if type(msg) is HelloAck:
                self._check_version(msg)
            self._apply_received(msgs)
            out.append(msg)
            if self.state is _OPEN:
                rest = decoder.feed(b"")
                self._apply_received(rest)
                out.extend(rest)
                break
            msgs = decoder.feed(b"", max_messages=1)
        return out

    def _apply_received(self, msgs: list[Message]) -> None:
        their_role = self.their_role
        for msg in msgs:
            try:
                self._apply(their_role, msg)
            except _Illegal as exc:
                raise RemoteProtocolError(str(exc)) from None

    def receive_eof(self) -> None:
        """The peer closed its side.  Raises ``MalformedFrame`` if a frame was cut short."""
        if self._error is not None:
            raise self._error
        try:
            self._decoder.eof()
        except RemoteProtocolError as exc:
            self._fail(exc)
            raise
        self.state = ConnState.CLOSED

    def close(self) -> None:
        """We are done with this connection: nothing more may be sent or received."""
        self.state = ConnState.CLOSED

    # ------------------------------------------------------------ internals

    def _fail(self, exc: RemoteProtocolError) -> None:
        self._error = exc
        self.state = ConnState.CLOSED

    def _check_version(self, msg: HelloAck) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"edge speaks protocol version {msg.protocol_version}, we speak {PROTOCOL_VERSION}"
            )

    def _apply(self, sender: Role, msg: Message) -> None:
        """The one place where state changes.  Raises ``_Illegal`` before changing anything."""
        msg_type = type(msg)
        next_state = CONNECTION_TRANSITIONS[self.state].get((sender, msg_type))
        if next_state is None:
            raise _Illegal(
                f"{sender.value} may not send {msg_type.__name__} in connection state "
                f"{self.state.value}"
            )
        stream_id = getattr(msg, "stream_id", None)
        if stream_id is not None:  # (no handshake message has a stream)
            self._apply_stream(sender, msg, stream_id)
        elif isinstance(msg, Hello):
            self.hello = msg
        elif isinstance(msg, HelloAck):
            self.hello_ack = msg
            self._decoder.max_frame_bytes = self.max_frame_bytes  # the session is open
        elif isinstance(msg, Refused):
            self.refused = msg
        self.state = next_state

    def _apply_stream(self, sender: Role, msg: Message, stream_id: int) -> None:
        msg_type = type(msg)
        name = msg_type.__name__
        if msg_type in _OPENERS:
            event = StreamEvent.OPEN
        elif msg_type in _REPLIES:
            event = StreamEvent.TERMINAL if is_terminal(msg) else StreamEvent.REPLY
        elif msg_type is Cancel:
            event = StreamEvent.CANCEL
        else:
            event = StreamEvent.CREDIT
        state = self.stream_state(stream_id)
        next_state = STREAM_TRANSITIONS[state].get(event)
        if next_state is None:
            raise _Illegal(
                f"{sender.value} may not send {name} on {state.value} stream {stream_id}"
            )
        if event is StreamEvent.OPEN:
            if stream_id <= self._last_stream_id:
                raise _Illegal(
                    f"{name} reuses stream id {stream_id} (ids must increase; last was "
                    f"{self._last_stream_id})"
                )
            window = getattr(msg, "window", 0)
            if msg_type is not NodeConfig and window < 1:
                raise _Illegal(f"{name} on stream {stream_id} has window {window} (must be >= 1)")
            self._streams[stream_id] = StreamInfo(_OPENERS[msg_type], next_state, window)
            self._last_stream_id = stream_id
            return
        info = self._streams.get(stream_id)
        if info is None:  # CLOSED stream: the ignored Cancel/Credit race
            return
        if event is StreamEvent.REPLY or event is StreamEvent.TERMINAL:
            if info.kind not in _REPLIES[msg_type]:
                raise _Illegal(f"{name} is not a reply to the {info.kind} stream {stream_id}")
            if event is StreamEvent.REPLY:
                if info.credit <= 0:
                    raise _Illegal(f"{name} on stream {stream_id} exceeds the credit window")
                info.credit -= 1
            else:
                del self._streams[stream_id]
                return
        elif event is StreamEvent.CREDIT:
            frames = msg.frames if isinstance(msg, Credit) else 0
            if frames < 1:
                raise _Illegal(f"Credit of {frames} frames on stream {stream_id} (must be >= 1)")
            info.credit += frames
        info.state = next_state


__all__ = [
    "CONNECTION_TRANSITIONS",
    "STREAM_TRANSITIONS",
    "ConnState",
    "Connection",
    "Role",
    "StreamEvent",
    "StreamInfo",
    "StreamState",
    "WireError",
]
