"""Length-prefixed msgpack frames: ``[4-byte big-endian length][msgpack body]``.

Why this shape: the length comes first so a receiver can reject an oversized
frame *before* buffering its payload (a hostile or broken peer must not make us
allocate 4 GiB), and msgpack via msgspec decodes straight into the typed
``Message`` union with one reusable decoder.

``FrameDecoder`` is incremental and sans-IO: feed it any slices of the byte
stream (one byte at a time works) and it returns every complete message.  After
a ``feed`` returns, it holds less than one frame (at most ``4 + max_frame_bytes
- 1`` bytes), so its memory is bounded.  Once it raised, it stays broken.

Before a session is open the peer is not authenticated, and the handshake's
frames are a few hundred bytes: ``HANDSHAKE_MAX_FRAME_BYTES`` is the cap a
``wire.connection.Connection`` holds its decoder to until ``HelloAck`` has
crossed, so an unauthenticated peer can make the receiver hold at most one
read plus a few KiB, never a session-sized frame.
"""

from __future__ import annotations

import re

import msgspec

from wire.errors import FrameTooLarge, LocalProtocolError, MalformedFrame
from wire.messages import Message

#: Default cap of one frame's body: 16 MiB.
MAX_FRAME_BYTES = 16 * 1024 * 1024
PREFIX_BYTES = 4
#: Cap of one frame's body before the session is open (``Hello``, ``Challenge``,
#: ``Proof``, ``HelloAck``, ``Refused``).  The largest legal one (ids of
#: ``MAX_HANDSHAKE_ID_CHARS``, the longest nonces and salt) is under 3 KiB.
HANDSHAKE_MAX_FRAME_BYTES = 8 * 1024
#: Longest node or edge id a handshake frame has room for (config validation
#: holds ids to it).
MAX_HANDSHAKE_ID_CHARS = 1024

#: A length prefix that reads ``HTTP``: the peer is an HTTP server answering (a
#: node pointed at an HTTP port, such as the edge's OpenAI listener).
HTTP_SERVER_REASON = "the peer answered in HTTP: this is an HTTP server, not an iopd wire listener"
#: A length prefix that reads as an HTTP method: an HTTP client dialled a wire listener.
HTTP_CLIENT_REASON = "the peer sent an HTTP request: this is an HTTP client, not an iopd wire peer"
_HTTP_METHODS = frozenset(
    (b"GET ", b"POST", b"PUT ", b"HEAD", b"DELE", b"OPTI", b"PATC", b"CONN", b"TRAC", b"PRI ")
)

_encoder = msgspec.msgpack.Encoder()
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def encode_frame(msg: Message, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Encode ``msg`` as one frame (length prefix + msgpack body).

    Raises ``LocalProtocolError`` when the body would exceed ``max_frame_bytes``
    (the peer would reject it anyway).
    """
    buf = bytearray(64)
    _encoder.encode_into(msg, buf, PREFIX_BYTES)
    size = len(buf) - PREFIX_BYTES
    if size > max_frame_bytes:
        raise LocalProtocolError(
            f"outgoing {type(msg).__name__} frame of {size} bytes exceeds the "
            f"{max_frame_bytes}-byte frame limit"
        )
    buf[0:PREFIX_BYTES] = size.to_bytes(PREFIX_BYTES, "big")
    return bytes(buf)


class FrameDecoder:
    """Incremental decoder from raw bytes to wire messages.

    ``feed(data)`` returns the messages completed by ``data`` (possibly none).
    Raises ``FrameTooLarge`` as soon as a length prefix over the cap is seen,
    and ``MalformedFrame`` for a zero-length frame or an undecodable body.
    ``max_frame_bytes`` may be changed between two ``feed`` calls (the
    handshake's small cap, then the session's); ``feed(data, max_messages=1)``
    stops after one message so a caller can change it in between.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be >= 1")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)
        self._broken: MalformedFrame | FrameTooLarge | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for a frame that is not complete yet."""
        return len(self._buf)

    def feed(
        self, data: bytes | bytearray | memoryview, *, max_messages: int | None = None
    ) -> list[Message]:
        """Add ``data`` to the stream; return the messages it completes.

        With ``max_messages``, at most that many: the rest stays buffered for
        the next call (``feed(b"")`` decodes it).
        """
        if self._broken is not None:
            raise self._broken
        buf = self._buf
        buf += data
        out: list[Message] = []
        pos = 0
        end = len(buf)
        try:
            while end - pos >= PREFIX_BYTES:
                if max_messages is not None and len(out) >= max_messages:
                    break
                size = int.from_bytes(buf[pos : pos + PREFIX_BYTES], "big")
                if size == 0:
                    raise MalformedFrame("zero-length frame")
                if size > self.max_frame_bytes:
                    raise FrameTooLarge(
                        _too_large(bytes(buf[pos : pos + PREFIX_BYTES]), size, self.max_frame_bytes)
                    )
                start = pos + PREFIX_BYTES
                stop = start + size
                if stop > end:
                    break
                out.append(self._decode(buf[start:stop]))
                pos = stop
        except (MalformedFrame, FrameTooLarge) as exc:
            self._broken = exc
            buf.clear()
            raise
        if pos:
            del buf[:pos]
        return out

    def _decode(self, body: bytearray) -> Message:
        try:
            return self._decoder.decode(body)
        except ValueError as exc:
            # msgspec.DecodeError, ValidationError and UnicodeDecodeError are all
            # ValueError.  The reason names the problem, never the payload.
            raise MalformedFrame(f"undecodable frame: {_describe(exc)}") from None

    def eof(self) -> None:
        """The byte stream ended; raise ``MalformedFrame`` if a frame was cut short."""
        if self._broken is not None:
            raise self._broken
        if self._buf:
            n = len(self._buf)
            self._buf.clear()
            self._broken = MalformedFrame(f"connection closed inside a frame ({n} bytes pending)")
            raise self._broken


def _too_large(prefix: bytes, size: int, limit: int) -> str:
    """Why a length prefix is refused: HTTP bytes are named as such (every HTTP
    response and request line starts with a prefix far over any frame limit)."""
    if prefix == b"HTTP":
        return HTTP_SERVER_REASON
    if prefix in _HTTP_METHODS:
        return HTTP_CLIENT_REASON
    return f"frame length {size} exceeds the {limit}-byte limit"


def _describe(exc: ValueError) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return "invalid UTF-8 in a string"
    if isinstance(exc, msgspec.ValidationError):
        # e.g. "Invalid value 'Bogus' - at `$.t`": keep the schema path, drop
        # any quoted value (it came from the peer and could be anything).
        return "validation error: " + _QUOTED.sub("'…'", str(exc))[:160]
    return type(exc).__name__ + ": " + _QUOTED.sub("'…'", str(exc))[:160]
