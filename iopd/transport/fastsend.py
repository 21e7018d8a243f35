"""Writes (and reads) that skip trio's socket layers on a plain socket stream.

Why: ``trio.SocketStream.send_all`` wraps every write in a conflict detector,
an error-translating context manager, memoryview bookkeeping, an async
``_try_sync`` block and, after a successful ``send``, a full trip through the
scheduler.  Measured here that is ~20 µs per small write against ~1.5 µs for
the ``write(2)`` itself, and every request crosses four such writes (caller
<- edge -> node -> provider, node -> edge).  On loopback and LAN links the
socket buffer almost always has room, so the fast path is the common one.

``write_now`` tries one non-blocking ``os.write`` on a plain
``trio.SocketStream`` (never TLS, never a test stream) and reports how many
bytes the kernel took; the caller finishes whatever is left with trio's own
``send_all``, which then waits for the socket as usual (and decides what a
cancel in that wait means for it: the wire channel shields it, the HTTP
server marks the connection torn).  Errors are trio's:
``trio.BrokenResourceError`` for a broken connection, and
``trio.ClosedResourceError`` for a closed socket.

Callers must not run two sends on one stream at once (trio would raise
``BusyResourceError``; a fast write could interleave bytes).  Every user in
iopd already serializes its writes: the wire channel's single writer, one
response at a time per HTTP connection, one request at a time per provider
connection.

``receive_some`` is the read side, for the per-piece loops (a streamed
reply's chunks at the node, the wire reader at both daemons, the HTTP
server's reader): trio's ``receive_some`` first tries a ``recv``, which in a
relay loop almost always fails (the last piece was just drained), then waits
for readability and receives again, through the same layers as a send.
Here the task waits for readability first and reads once: one ``read(2)``
per piece instead of two, and the same single scheduler round per piece
(trio takes a round after an immediate success too).  Measured at 200
concurrent streams (``scripts/bench_streams.py``), with the read timeout as
a plain cancel scope instead of ``fail_after``: see ``docs/performance.md``.
"""

from __future__ import annotations

import errno
import os

import trio

# The errnos trio treats as "this socket was already closed".
_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.ENOTSOCK})


async def receive_some(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes:
    """``stream.receive_some(max_bytes)``: at most ``max_bytes``, ``b""`` at EOF.

    On a plain ``trio.SocketStream``: wait until the socket is readable (a
    checkpoint: cancel and scheduling behave as with trio's call), then one
    ``read(2)``.  Any other stream is left to trio.  Errors are trio's:
    ``trio.ClosedResourceError`` for a closed socket, ``trio.BrokenResourceError``
    for a broken connection, ``trio.BusyResourceError`` when another task
    already waits on it.
    """
    if type(stream) is not trio.SocketStream:
        return bytes(await stream.receive_some(max_bytes))  # (a copy only off the fast path)
    while True:
        fd = await wait_readable(stream)
        data = read_ready(stream, max_bytes, fd)
        if data is not None:
            return data
        # a spurious wake-up: wait again


async def wait_readable(stream: trio.SocketStream) -> int:
    """Wait until the socket is readable (a checkpoint); its file descriptor.

    For a task that decides after the wait whether to read at all (the HTTP
    server's watcher, ``iopd.http.transport``): a socket left unread stays
    readable for the next task that waits on it.
    """
    fd = stream.socket.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("this socket was already closed")
    await trio.lowlevel.wait_readable(fd)
    return fd


def read_ready(stream: trio.SocketStream, max_bytes: int, fd: int) -> bytes | None:
    """One non-blocking ``read(2)`` after :func:`wait_readable` returned ``fd``:
    at most ``max_bytes``, ``b""`` at EOF, None when nothing is there (yet)."""
    if stream.socket.fileno() != fd:  # closed meanwhile (its number may be reused)
        raise trio.ClosedResourceError("this socket was already closed")
    try:
        return os.read(fd, max_bytes)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno in _CLOSED_ERRNOS:
            raise trio.ClosedResourceError("this socket was already closed") from None
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc


def write_now(stream: trio.abc.SendStream, data: bytes | memoryview) -> int:
    """Write what the socket takes right now, without blocking or yielding.

    Returns the number of bytes written: 0 when the socket is full, or when
    ``stream`` is not a plain socket stream (then nothing is attempted).
    """
    if type(stream) is not trio.SocketStream:
        return 0
    sock = stream.socket
    if sock.did_shutdown_SHUT_WR:
        return 0  # trio's send_all raises the right error
    fd = sock.fileno()
    if fd < 0:
        return 0
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0
    except OSError as exc:
        if exc.errno in _CLOSED_ERRNOS:
            raise trio.ClosedResourceError("this socket was already closed") from None
        raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
