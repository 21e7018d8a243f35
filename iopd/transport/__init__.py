"""trio <-> wire glue: ``WireChannel`` (reader task, locked writer, heartbeats),
``serve_wire`` (listen), ``dial`` + ``Backoff``, and the TLS contexts."""

from iopd.transport.channel import ChannelClosed, WireChannel
from iopd.transport.dial import Backoff, DialError, dial
from iopd.transport.listen import serve_wire
from iopd.transport.tls import TLSConfigError, client_ssl_context, server_ssl_context

__all__ = [
    "Backoff",
    "ChannelClosed",
    "DialError",
    "TLSConfigError",
    "WireChannel",
    "client_ssl_context",
    "dial",
    "serve_wire",
    "server_ssl_context",
]
