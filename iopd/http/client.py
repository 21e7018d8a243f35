"""A small HTTP/1.1 client on trio, used by the node to reach providers.

Why our own: the node needs exactly three things from a client — keep-alive
reuse (LLM servers are called many times a second), bytes relayed as they
arrive (SSE), and *closing* the upstream connection when a run is cancelled
(that is how a provider learns the caller went away).  A general-purpose
client hides the last one behind pool logic; here it is explicit:

* a connection goes back to the idle pool only when its response was read to
  the end, the provider allows keep-alive and nothing unexpected followed the
  response; anything else (cancel, error, a body left unread) closes it;
* the wire format is ``iopd.http.h1`` (sans-IO, written for this client: h11
  cost ~250 µs on a streamed reply's first-chunk path, see that module);
* every low-level failure is mapped in one place (``_map_errors``) into
  ``ProviderConnectError`` / ``ProviderTimeoutError`` / ``ProviderProtocolError``;
* timeouts: a ``fail_after`` scope of ``connect_timeout`` around the dial and
  of ``read_timeout`` around a send that waits; ``read_timeout`` bounds every
  single receive through the client's ``ReadWatch`` (``read_watch.py``).

A pooled connection may have been closed by the server while idle.  Before
reuse it is checked for readability (an idle socket that is readable has
seen EOF or junk), and a request that fails on a *reused* connection before
any response byte arrived is retried once on a fresh connection.
"""

from __future__ import annotations

import contextlib
import select
import ssl
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import trio
from trio.socket import SocketType

from iopd.http.client_errors import (
    ProviderConnectError,
    ProviderHTTPError,
    ProviderProtocolError,
    ProviderResetError,
    ProviderTimeoutError,
    _describe,
    _map_errors,
    _StaleConnection,
)
from iopd.http.h1 import H1ProtocolError
from iopd.http.h1_client import ResponseHead, ResponseReader, render_request
from iopd.http.read_watch import ReadWatch
from iopd.transport import fastsend

__all__ = [
    "ProviderConnectError",
    "ProviderHTTPClient",
    "ProviderHTTPError",
    "ProviderProtocolError",
    "ProviderResetError",
    "ProviderResponse",
    "ProviderTimeoutError",
    "EarlyStart",
    "FullResponse",
    ]

_RECEIVE_BYTES = 65536
# Request headers the client owns: framing and routing are computed here.
_CLIENT_OWNED_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class _Connection:
    """One TCP (or TLS) connection; ``reader`` parses the response in progress."""

    def __init__(self, stream: trio.abc.Stream, sock: SocketType | None, watch: ReadWatch) -> None:
        self.stream = stream
        self.sock = sock
        self.reader: ResponseReader | None = None  # None between exchanges
        self.reused = False
        self._watch = watch
        self._timed_out = False

    def looks_reusable(self) -> bool:
        """False when the idle socket is readable, i.e. the server closed it."""
        if self.reader is not None:
            return False
        if self.sock is None:
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    async def receive(self, read_timeout: float) -> None:
        """Feed the socket's next bytes (or its EOF) to ``reader``; a wait of
        ``read_timeout`` raises ``trio.TooSlowError``.

        Once per piece of a streamed reply, so the timeout is the client's
        ``ReadWatch`` (a clock read and a dict entry) rather than a cancel
        scope per read: the watch closes the socket of a wait that lasts too
        long, which wakes this task.
        """
        assert self.reader is not None
        watch = self._watch
        watch.begin(self, read_timeout, self._expire)
        try:
            data = await fastsend.receive_some(self.stream, _RECEIVE_BYTES)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            if self._timed_out:
                raise trio.TooSlowError from None
            raise
        finally:
            watch.end(self)
        if data:
            self.reader.receive_data(data)
        else:
            self.reader.receive_eof()

    def _expire(self) -> None:
        """The watch's verdict: this wait lasted ``read_timeout``."""
        self._timed_out = True
        self.close_now()

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    def close_now(self) -> None:
        """Close the socket from synchronous code (no TLS goodbye: an abort)."""
        if self.sock is not None:
            self.sock.close()


@dataclass
class FullResponse:
    """A whole response, as returned by ``ProviderHTTPClient.request``."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


class ProviderResponse:
    """A response whose body is read as it arrives (``aiter_bytes``)."""

    def __init__(self, conn: _Connection, head: ResponseHead, read_timeout: float) -> None:
        assert conn.reader is not None
        self.status = head.status
        self.headers = head.headers
        self._conn = conn
        self._reader = conn.reader
        self._read_timeout = read_timeout
        # Body bytes taken from the buffer by ``body_ready`` (never read from
        # the socket), or the protocol error that taking them raised.
        self._ready = b""
        self._ready_error: H1ProtocolError | None = None

    @property
    def complete(self) -> bool:
        """The whole body was read."""
        return self._reader.complete and not self._ready

    def header(self, name: str) -> str | None:
        """First value of header ``name`` (case-insensitive), or None."""
        lname = name.lower()
        for key, value in self.headers:
            if key == lname:
                return value
        return None

    def body_ready(self) -> bool:
        """True when the body's first bytes (or its end) arrived with the head.

        Never reads from the socket: it only looks at what is buffered, so a
        caller may let the head wait for those bytes and write both at once
        without ever waiting for the provider.
        """
        if not self._ready and self._ready_error is None:
            try:
                self._ready = self._reader.read_body()
            except H1ProtocolError as exc:
                self._ready_error = exc  # raised by aiter_bytes, after nothing
                return False
        return bool(self._ready) or self._reader.complete

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Yield body bytes as they arrive (chunked encoding undone).

        Everything buffered is yielded as one piece (an SSE burst read at
        once: one relay frame and one write downstream instead of one per
        chunk), and never a wait for bytes that are not here yet.  Bytes that
        arrived before a malformed part are yielded before the error.
        """
        reader = self._reader
        conn = self._conn
        while True:
            data, self._ready = self._ready, b""
            with _map_errors("read body"):
                if self._ready_error is not None:
                    error, self._ready_error = self._ready_error, None
                    raise error
                if not data:
                    data = reader.read_body()
                    while not data and not reader.complete:
                        await conn.receive(self._read_timeout)
                        data = reader.read_body()
            if data:
                yield data
            if reader.complete:
                return

    async def read(self, limit: int | None = None) -> bytes:
        """Read the rest of the body (at most ``limit`` bytes are kept)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.aiter_bytes():
            if limit is not None and size >= limit:
                continue
            parts.append(chunk)
            size += len(chunk)
        body = b"".join(parts)
        return body if limit is None else body[:limit]


class EarlyStart:
    """A request ``ProviderHTTPClient.start_early`` already wrote on a pooled connection.

    The node's one early-start type (see ``docs/ARCHITECTURE.md``, "Early
    start").  Its holder either hands it on — in the end to the same client's
    ``stream(..., early=...)``, which takes it — or ``abandon()``s it, which
    closes the connection (the provider sees the request aborted).
    ``abandon()`` is idempotent and a no-op once taken, so the owner of the
    stream may always call it when done.
    """

    __slots__ = ("client", "conn", "rest", "_taken")

    def __init__(self, client: ProviderHTTPClient, conn: _Connection, rest: bytes) -> None:
        self.client = client  # the only client whose stream() may take it
        self.conn = conn
        self.rest = rest  # what the socket did not take at once
        self._taken = False

    def take(self) -> EarlyStart | None:
        """Claim it (once); None when it was already taken or abandoned."""
        if self._taken:
            return None
        self._taken = True
        return self

    def abandon(self) -> None:
        """Close its connection unless it was taken (synchronous; idempotent)."""
        if not self._taken:
            self._taken = True
            self.conn.close_now()


class ProviderHTTPClient:
    """Keep-alive HTTP/1.1 client for one provider ``base_url`` (http or https).

    For https the server certificate is verified against ``ssl_context``
    (default: the system trust store) and ``base_url``'s host name.

    ``connect_timeout`` bounds the dial (and TLS handshake); ``read_timeout``
    bounds every single read or write, so a stream that keeps producing
    tokens never times out while a hung provider does.  ``first_byte_timeout``
    (the lower of the two counts) bounds the wait for the first byte of a
    response once the request is sent: a provider that accepts and never
    answers is given up on well before a stream's ``read_timeout``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        first_byte_timeout: float | None = None,
        max_idle_connections: int = 8,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unsupported provider base_url scheme or host: {parts.scheme!r}")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path_prefix = parts.path.rstrip("/")
        default_port = 443 if parts.scheme == "https" else 80
        host_for_header = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (
            host_for_header if self.port == default_port else f"{host_for_header}:{self.port}"
        )
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        first = read_timeout if first_byte_timeout is None else min(read_timeout, first_byte_timeout)
        self.first_byte_timeout = first
        self._first_byte_key = "read_timeout" if first == read_timeout else "first_byte_timeout"
        self.max_idle_connections = max_idle_connections
        self._idle: deque[_Connection] = deque()
        self._ssl_context = ssl_context  # https; None = system trust store
        self._closed = False
        self._watch = ReadWatch()  # read_timeout of every receive
        #: How many connections this client has opened (tests, diagnostics).
        self.connections_opened = 0

    # ------------------------------------------------------------ pool

    async def _open(self) -> _Connection:
        with _map_errors("connect"), trio.fail_after(self.connect_timeout):
            tcp = await trio.open_tcp_stream(self.host, self.port)
            stream: trio.abc.Stream = tcp
            if self.scheme == "https":
                if self._ssl_context is None:
                    self._ssl_context = ssl.create_default_context()
                tls = trio.SSLStream(tcp, self._ssl_context, server_hostname=self.host)
                try:
                    await tls.do_handshake()
                except BaseException:
                    await trio.aclose_forcefully(tcp)
                    raise
                stream = tls
        self.connections_opened += 1
        return _Connection(stream, tcp.socket, self._watch)

    async def _acquire(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.looks_reusable():
                conn.reused = True
                return conn
            await conn.aclose()
        return await self._open()

    def _pool(self, conn: _Connection, response: ProviderResponse | None) -> bool:
        """Pool ``conn`` if its exchange finished cleanly; False: close it."""
        reusable = (
            not self._closed
            and response is not None
            and response.complete
            and conn.reader is not None
            and conn.reader.reusable
        )
        conn.reader = None
        if reusable and len(self._idle) < self.max_idle_connections:
            self._idle.append(conn)
            return True
        return False

    async def aclose(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        while self._idle:
            await self._idle.pop().aclose()

    @property
    def idle_connections(self) -> int:
        """Number of pooled idle connections."""
        return len(self._idle)

    # ------------------------------------------------------------ requests

    def _build_headers(
        self, headers: Iterable[tuple[str, str]], body: bytes, method: str
    ) -> list[tuple[str, str]]:
        out = [("Host", self.host_header)]
        for name, value in headers:
            if name.lower() not in _CLIENT_OWNED_HEADERS:
                out.append((name, value))
        if body or method.upper() not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            out.append(("Content-Length", str(len(body))))
        return out

    @staticmethod
    def _begin(conn: _Connection, method: str, data: bytes) -> bytes:
        """Arm ``conn``'s response reader and write what the socket takes now
        (the whole request, most often); return the rest."""
        conn.reader = ResponseReader(head_only=method.upper() == "HEAD")
        written = fastsend.write_now(conn.stream, data)
        return data[written:] if written else data

    async def _start(
        self,
        conn: _Connection,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        rest: bytes | None = None,
    ) -> ProviderResponse:
        """Send the request (or, when ``start_early`` sent its start, the ``rest``)
        and read the response head."""
        try:
            if rest is None:
                try:
                    data = render_request(method, target, headers, body)
                except H1ProtocolError as exc:
                    raise ProviderProtocolError(f"cannot send request: {exc}") from None
                rest = self._begin(conn, method, data)
            if rest:
                with trio.fail_after(self.read_timeout):
                    await conn.stream.send_all(rest)
        except (trio.BrokenResourceError, OSError) as exc:
            if conn.reused:
                raise _StaleConnection() from None
            raise ProviderResetError(
                f"connection lost sending the request: {_describe(exc)}"
            ) from None
        reader = conn.reader
        assert reader is not None
        while True:
            try:
                head = reader.read_head()
            except H1ProtocolError:
                # Server hung up before a response on a reused connection: the
                # classic keep-alive race (it closed the idle socket meanwhile).
                if conn.reused and not reader.received_any:
                    raise _StaleConnection() from None
                raise
            if head is not None:
                return ProviderResponse(conn, head, self.read_timeout)
            first = not reader.received_any
            try:
                await conn.receive(self.first_byte_timeout if first else self.read_timeout)
            except trio.TooSlowError:
                if not first:
                    raise
                raise ProviderTimeoutError(
                    f"the provider sent no response within {self.first_byte_timeout:g}s "
                    f"({self._first_byte_key})"
                ) from None
            except (trio.BrokenResourceError, OSError):
                # Our request may meet the closed socket: a reset counts as an EOF.
                if conn.reused and not reader.received_any:
                    raise _StaleConnection() from None
                raise

    def start_early(
        self, method: str, path: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b""
    ) -> EarlyStart | None:
        """Write a request on a pooled connection at once, without waiting; or None.

        Synchronous and best effort, for a caller that cannot await yet (the
        node's wire reader, so that the request leaves before a scheduler
        round): only when an idle connection is ready and the request renders.
        The result must go to ``stream(..., early=...)`` with the same
        arguments, or be ``abandon()``-ed.
        """
        if self._closed or not self._idle or not self._idle[-1].looks_reusable():
            return None  # (a stale idle connection is closed by the next stream())
        target = self.path_prefix + (path if path.startswith("/") else "/" + path)
        try:
            data = render_request(method, target, self._build_headers(headers, body, method), body)
        except H1ProtocolError:
            return None  # stream() reports it
        conn = self._idle.pop()
        conn.reused = True
        try:
            rest = self._begin(conn, method, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            conn.close_now()  # a stale connection; stream() dials afresh
            return None
        return EarlyStart(self, conn, rest)

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        *,
        early: EarlyStart | None = None,
    ) -> AsyncIterator[ProviderResponse]:
        """Send one request; yield the response once its head has arrived.

        The body is read with ``resp.aiter_bytes()``.  Leaving the block
        before the body was read to the end (cancel, error, early exit)
        closes the connection instead of pooling it.  ``early``: the same
        request, already begun by this client's ``start_early`` (this call
        takes it); one begun by another client is abandoned.
        """
        if early is not None and early.client is not self:
            early.abandon()  # begun on another client (a registry swap in between)
            early = None
        early = early.take() if early is not None else None
        if self._closed:
            if early is not None:
                early.conn.close_now()
            raise ProviderConnectError("client is closed")
        target = self.path_prefix + (path if path.startswith("/") else "/" + path)
        # Built only to render the request here: an early start wrote it already
        # (``headers`` may be lazy; it is iterated at most once).
        req_headers: list[tuple[str, str]] = []
        response: ProviderResponse | None = None
        conn: _Connection | None = None
        try:
            for attempt in range(2):
                rest = None
                if early is not None:
                    conn, rest, early = early.conn, early.rest, None
                else:
                    conn = await self._acquire()
                    if not req_headers:
                        req_headers = self._build_headers(headers, body, method)
                try:
                    with _map_errors("request"):
                        response = await self._start(
                            conn, method, target, req_headers, body, rest
                        )
                    break
                except _StaleConnection:
                    await conn.aclose()
                    conn = None
                    if attempt == 1:  # pragma: no cover - fresh connections are never "reused"
                        raise ProviderProtocolError("provider closed the connection") from None
            assert response is not None and conn is not None
            yield response
        finally:
            # Pooled without a checkpoint (the common case, on the path of
            # every reply: no shielded scope to enter); closed, shielded.
            if conn is not None and not self._pool(conn, response):
                with trio.CancelScope(shield=True):
                    await conn.aclose()

    async def request(
        self,
        method: str,
        path: str,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes = b"",
        *,
        max_body_bytes: int | None = None,
    ) -> FullResponse:
        """Send one request and read the whole response body."""
        async with self.stream(method, path, headers, body) as resp:
            data = await resp.read(max_body_bytes)
            return FullResponse(resp.status, resp.headers, data)
