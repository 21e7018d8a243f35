"""The hub's wire ``Connection``: frames counted for the metrics, the peer's failure kept.

Apart from ``hub.py`` so that the hub's module stays about sessions.
"""

from __future__ import annotations

from collections.abc import Callable

from iopd.edge.nodes.node_session import NodeSession
from iopd.vocabulary import FrameDirection, WireErrorReason
from wire.connection import Connection, Role
from wire.errors import FrameTooLarge, MalformedFrame, RemoteProtocolError
from wire.messages import Message

__all__ = ["MeteredConnection", "end_of_batch", "wire_error_reason"]


class MeteredConnection(Connection):
    """A ``Connection`` that reports frame counts and remembers why the peer failed it.

    Frames are tallied as they are sent and read, and reported by
    :meth:`report` at the end of each batch read (after the replies it
    brought were written to their callers: a metrics call is not on their
    path; a node answers every request, and heartbeats at the latest), at a
    protocol error, at EOF and at close.
    """

    def __init__(
        self,
        role: Role,
        *,
        max_frame_bytes: int,
        on_frames: Callable[[FrameDirection, int], None],
    ) -> None:
        super().__init__(role, max_frame_bytes=max_frame_bytes)
        self._on_frames = on_frames
        self._unreported_out = 0
        self._unreported_in = 0
        self.remote_error: RemoteProtocolError | None = None

    def report(self) -> None:
        """Report the frames counted since the last report."""
        out, self._unreported_out = self._unreported_out, 0
        if out:
            self._on_frames("out", out)
        frames_in, self._unreported_in = self._unreported_in, 0
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
            self.report()
            raise
        self._unreported_in += len(msgs)
        return msgs

    def receive_eof(self) -> None:
        self.report()
        try:
            super().receive_eof()
        except RemoteProtocolError as exc:
            self.remote_error = self.remote_error or exc
            raise

    def close(self) -> None:
        self.report()
        super().close()


def end_of_batch(session: NodeSession, conn: MeteredConnection) -> None:
    """The hub reader's batch is dispatched: the replies it brought are
    written first, then its frames counted."""
    session.end_of_batch()
    conn.report()


def wire_error_reason(conn: MeteredConnection) -> WireErrorReason:
    """The ``iop_wire_protocol_errors_total`` reason of a protocol failure on ``conn``."""
    exc = conn.remote_error
    if isinstance(exc, FrameTooLarge):
        return "frame_too_large"
    if isinstance(exc, MalformedFrame):
        return "malformed"
    return "protocol"
