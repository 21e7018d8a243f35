"""The response side of one request: whole or streamed, one head renderer.

Why here and not in the server: every response this server writes, the
handler's and the server's own refusals alike, goes through
:class:`Responder`, so a head is rendered in exactly one place
(:meth:`Responder._head`: ``Server``, ``Date``, the caller's headers, the
framing, ``Connection: close`` when the connection ends after it) and its
header names and values are checked on the way out (a relayed header can
never split the response).  The shapes written are few: a whole response
with ``Content-Length``, or a streamed one, chunked on HTTP/1.1 and
close-delimited on HTTP/1.0.

``hold=True`` keeps bytes back until the next unheld write, so a handler that
already has the next piece in hand sends the head and the first chunk in one
write (one syscall, one TCP segment on the first-chunk path).
"""

from __future__ import annotations

import time
from email.utils import formatdate
from typing import Protocol, cast

import trio

from iopd.http.h1 import render_response_head


class ClientDisconnected(Exception):
    """Raised by :class:`Responder` when the client is gone while writing.

    The handler's cancel scope is cancelled at the same time, so the handler's
    cleanup sees ``trio.Cancelled`` at its next checkpoint unless shielded.
    """


class AbortResponse(Exception):
    """Raise from a handler to cut a response that already started.

    An expected outcome (a relay that cannot be finished), so the connection
    is closed without a traceback in the log; the handler logs the request.
    """


class ResponseServer(Protocol):
    """What a :class:`Responder` needs of the server."""

    server_header: str

    @property
    def closing(self) -> bool:
        """The server is shutting down: every response closes its connection."""


class ResponseSink(Protocol):
    """What a :class:`Responder` writes through: the server's connection."""

    #: A write was cut halfway: nothing more may be written.
    torn: bool

    @property
    def server(self) -> ResponseServer:
        """The server the connection belongs to."""

    async def send_bytes(self, data: bytes, scope: trio.CancelScope | None) -> None:
        """Write ``data``; a broken connection cancels ``scope`` and raises
        :class:`ClientDisconnected`."""

    def send_now(self, data: bytes) -> bool:
        """Write ``data`` without awaiting if the socket takes it now (else False);
        a part the kernel did not take is written by the next ``send_bytes``."""

    @property
    def unsent(self) -> bool:
        """Part of a ``send_now`` waits for the next ``send_bytes``."""


_date_second = -1
_date_value = ""

#: Framing headers are this module's: a handler's are dropped from a streamed head.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_CHUNKED_END = b"0\r\n\r\n"


def _http_date() -> str:
    """The ``Date`` header value, formatted at most once per second."""
    global _date_second, _date_value
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_value = formatdate(now, usegmt=True)
    return _date_value


class Responder:
    """Writes the response to one request: whole (``send``) or streamed.

    Use from one task at a time.  Writing to a client that went away raises
    :class:`ClientDisconnected`.
    """

    __slots__ = (
        "_conn",
        "_head_only",
        "_scope",
        "_held",
        "_chunked",
        "_extra",
        "keep_alive",
        "started",
        "finished",
    )

    def __init__(
        self,
        conn: ResponseSink,
        head_only: bool,
        scope: trio.CancelScope | None,
        *,
        keep_alive: bool = True,
        chunked: bool = True,
        extra_headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self._conn = conn
        self._head_only = head_only
        self._scope = scope
        # Bytes produced with ``hold=True`` and not written yet: they go out
        # with the next unheld write (one send instead of several).
        self._held = b""
        # Streamed bodies: chunked (HTTP/1.1) or delimited by the close (HTTP/1.0).
        self._chunked = chunked
        # Added to the head, replacing the handler's headers of the same names
        # (``HeadContext.response_headers``).
        self._extra = extra_headers
        #: False when the connection closes after this response.
        self.keep_alive = keep_alive
        #: True once the status line has been produced.
        self.started = False
        #: True once the response is complete.
        self.finished = False

    def _head(
        self, status: int, headers: list[tuple[str, str]], framing: list[tuple[str, str]]
    ) -> bytes:
        if self.started:
            raise RuntimeError("response already started")
        conn = self._conn
        server = conn.server
        out = [("server", server.server_header), ("date", _http_date())]
        extra = self._extra
        if extra:
            replaced = {name.lower() for name, _ in extra}
            out += [(k, v) for k, v in headers if k.lower() not in replaced]
            out += extra
        else:
            out += headers
        out += framing
        if server.closing:
            self.keep_alive = False
        if not self.keep_alive:
            out.append(("connection", "close"))
        head = render_response_head(status, out)
        self.started = True
        return head

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """Send a whole response; ``Content-Length`` is added (do not pass one)."""
        no_body = status < 200 or status == 204 or status == 304
        framing = [] if no_body else [("content-length", str(len(body)))]
        data = self._head(status, headers, framing)
        if body and not no_body and not self._head_only:
            data += body
        self.finished = True
        await self._emit(data, False)

    async def start(
        self, status: int, headers: list[tuple[str, str]], *, hold: bool = False
    ) -> None:
        """Start a streamed response (chunked on HTTP/1.1, close-delimited on 1.0).

        Framing headers in ``headers`` (``Content-Length``, ``Transfer-Encoding``,
        ``Connection``) are dropped: the framing is this server's.
        ``hold=True`` keeps the head back until the next ``write``/``end``/``flush``:
        for a caller that already has the next piece in hand, so the whole
        response leaves in one send.
        """
        self.start_held(status, headers)
        if not hold:
            await self._emit(b"", False)

    async def write(self, data: bytes, *, hold: bool = False) -> None:
        """Write one piece of a streamed response (empty data is ignored).

        ``hold=True``: as for :meth:`start`, the bytes wait for the next unheld write.
        """
        if not self.started or self.finished:
            raise RuntimeError("write() outside a started, unfinished response")
        if not data or self._head_only:
            return
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        await self._emit(data, hold)

    # -- The same steps without awaiting, for a producer in another task while
    # the handler is parked (the passthrough relay's wire reader): the pieces
    # are held, then ``flush_nowait`` writes them in one go if the socket
    # takes them; what it cannot write is left to the handler.

    def start_held(self, status: int, headers: list[tuple[str, str]]) -> None:
        """:meth:`start` with ``hold=True``, without awaiting."""
        headers = [(k, v) for k, v in headers if k.lower() not in _FRAMING_HEADERS]
        if self._chunked:
            framing = [("transfer-encoding", "chunked")]
        else:
            framing = []
            self.keep_alive = False  # the close ends the body
        self._held += self._head(status, headers, framing)

    def write_held(self, data: bytes) -> bool:
        """:meth:`write` with ``hold=True``, without awaiting; False (nothing
        done) outside a started, unfinished response."""
        if not self.started or self.finished:
            return False
        if data and not self._head_only:
            self._held += b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        return True

    def end_held(self) -> bool:
        """:meth:`end` with its last bytes held, without awaiting; False
        (nothing done) before the start or after the end."""
        if not self.started or self.finished:
            return False
        self.finished = True
        if self._chunked and not self._head_only:
            self._held += _CHUNKED_END
        return True

    def flush_nowait(self) -> bool:
        """Write what is held without awaiting, if the socket takes it now.

        True when it went (or its start did: then the handler must call
        :meth:`send_unsent` before anything else) or nothing was held; False
        when nothing was written and it stays held for the handler's
        :meth:`flush` (the socket is full or broken, the connection is torn,
        the handler was cancelled).
        """
        if not self._held:
            return True
        if self._conn.send_now(self._held):
            self._held = b""
            return True
        return False

    @property
    def unsent(self) -> bool:
        """A :meth:`flush_nowait` left bytes for :meth:`send_unsent`."""
        return self._conn.unsent

    async def send_unsent(self) -> None:
        """Write what a :meth:`flush_nowait` could not (under ``send_timeout``)."""
        if self._conn.unsent:
            await self._conn.send_bytes(b"", self._scope)

    async def end(self) -> None:
        """Finish a streamed response."""
        if not self.started:
            raise RuntimeError("end() before start()")
        if self.finished:
            return
        self.finished = True
        await self._emit(_CHUNKED_END if self._chunked and not self._head_only else b"", False)

    async def flush(self) -> None:
        """Write what ``hold=True`` kept back, if anything."""
        if self._held and not self._conn.torn:
            await self._emit(b"", False)

    async def _emit(self, data: bytes, hold: bool) -> None:
        if self._held:
            data = self._held + data
            self._held = b""
        if hold:
            self._held = data
        elif data:
            await self._conn.send_bytes(data, self._scope)


class RewritingResponder:
    """A responder in front of another, rewriting what is written to it.

    A translation (one API's reply given to a caller of another) sits
    between a path that writes a provider's reply and the caller's
    ``Responder``: a subclass decides the head (``start_held``, ``send``)
    and turns each body piece (``rewrite``) and the end (``rewrite_end``)
    into the caller's bytes.  State (``started``, ``finished``, ``unsent``)
    is the inner responder's, so the request's error handling sees one
    response; ``as_responder`` hands it to a path typed for a ``Responder``
    (it has every method such a path calls).
    """

    __slots__ = ("_inner",)

    def __init__(self, inner: Responder) -> None:
        self._inner = inner

    def as_responder(self) -> Responder:
        return cast(Responder, self)

    # -- what a subclass rewrites (the defaults pass everything through)

    def rewrite(self, data: bytes) -> bytes:
        """The caller's bytes for one body piece (may hold some back: ``b""``)."""
        return data

    def rewrite_end(self) -> bytes:
        """The caller's last bytes, once the body has ended."""
        return b""

    # -- state: the inner responder's

    @property
    def started(self) -> bool:
        return self._inner.started

    @property
    def finished(self) -> bool:
        return self._inner.finished

    @property
    def unsent(self) -> bool:
        return self._inner.unsent

    # -- the Responder's methods, through ``rewrite``

    async def send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        await self._inner.send(status, headers, body)

    def start_held(self, status: int, headers: list[tuple[str, str]]) -> None:
        self._inner.start_held(status, headers)

    async def start(
        self, status: int, headers: list[tuple[str, str]], *, hold: bool = False
    ) -> None:
        self.start_held(status, headers)
        if not hold:
            await self._inner.flush()

    async def write(self, data: bytes, *, hold: bool = False) -> None:
        piece = self.rewrite(data)
        if piece:
            await self._inner.write(piece, hold=hold)

    def write_held(self, data: bytes) -> bool:
        if not self._inner.started or self._inner.finished:
            return False
        piece = self.rewrite(data)
        return self._inner.write_held(piece) if piece else True

    def end_held(self) -> bool:
        if not self._inner.started or self._inner.finished:
            return False
        tail = self.rewrite_end()
        if tail:
            self._inner.write_held(tail)
        return self._inner.end_held()

    async def end(self) -> None:
        if self._inner.finished:
            return
        tail = self.rewrite_end()
        if tail:
            await self._inner.write(tail, hold=True)
        await self._inner.end()

    def flush_nowait(self) -> bool:
        return self._inner.flush_nowait()

    async def send_unsent(self) -> None:
        await self._inner.send_unsent()

    async def flush(self) -> None:
        await self._inner.flush()


def json_typed(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` for a JSON body the responder writes itself: its own
    ``content-type``, no ``content-length`` of the body it replaces."""
    kept = [(k, v) for k, v in headers if k.lower() not in ("content-type", "content-length")]
    return [("content-type", "application/json"), *kept]
