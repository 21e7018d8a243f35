"""The one exception hierarchy of the sans-IO wire.

::

    WireError                      anything the wire layer rejects
    ├── LocalProtocolError         *we* tried something illegal (a bug on our side)
    └── RemoteProtocolError        the peer broke the protocol: close that connection
        ├── FrameTooLarge          length prefix over the cap (checked before buffering)
        ├── MalformedFrame         zero length, undecodable body, truncated at EOF
        └── VersionMismatch        the peer speaks another protocol version

Every error carries ``reason``: a short sentence that is safe to log (it never
contains frame payloads, so never a token).
"""

from __future__ import annotations


class WireError(Exception):
    """Base of every error raised by ``wire/``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LocalProtocolError(WireError):
    """We tried to send something the protocol does not allow in this state."""


class RemoteProtocolError(WireError):
    """The peer sent something the protocol does not allow; the connection is unusable."""


class FrameTooLarge(RemoteProtocolError):
    """A frame's length prefix exceeds the configured maximum."""


class MalformedFrame(RemoteProtocolError):
    """A frame that cannot be decoded into a wire message."""


class VersionMismatch(RemoteProtocolError):
    """The peer announced a protocol version we do not speak."""
