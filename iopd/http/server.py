"""A small HTTP/1.1 server on trio: the edge's OpenAI listener and the admin API.

Why no framework: measured on these machines (``STACK-NOTES.md``), quart-trio on
hypercorn's trio worker leaks connections (``Connection: close`` is not honoured,
idle keep-alive connections never time out), Quart's 60 s response timeout cuts
SSE streams, and a request costs ~580 µs of CPU there against ~140 µs for raw
h11 + trio.  The gateway's budget is <= 0.8 ms of CPU per request for edge and
node together, so the HTTP layer is written here, on a sans-IO parser
(``iopd.http.h1``), and kept lean: it is the hot path.

What this module guarantees:

* keep-alive, with ``idle_timeout`` between requests; ``Connection: close`` (or
  HTTP/1.0) closes after the response;
* headers must arrive within ``header_timeout`` and the body within
  ``body_timeout`` (else 408); oversized headers -> 431, oversized bodies -> 413
  (``Content-Length`` checked before reading, chunked bodies counted as they
  come); malformed HTTP -> 400;
* decide from the head: an optional ``head_check`` hook (the OpenAI listener's
  route, method and token) runs once the head is parsed, before any body byte
  is read; a refusal is answered from the head and the connection closes.
  ``Expect: 100-continue`` is answered only once the head passed every check;
* bounded by what an operator states: at most ``max_connections`` connections
  are served (past it new ones wait in the kernel's listen backlog: the server
  stops accepting until one closes), and at most ``max_inflight_body_bytes``
  of request bodies are being received at once across all connections
  (``Content-Length`` reserved from the head, chunked bodies counted as they
  come; past it 503 ``overloaded`` with ``Retry-After``);
* a write to the client that makes no progress for ``send_timeout`` (the
  kernel takes no byte: a caller that stopped reading) cuts the connection and
  cancels the handler, which frees whatever it held (a provider slot);
* the handler gets the whole body and runs in a cancel scope that is cancelled
  when the client goes away: one reader task per connection keeps a receive
  outstanding on the socket (pipelined bytes are buffered up to a cap), so EOF
  or a reset is seen at once and cancels the handler.  A client that
  half-closes its side after sending counts as gone.  (A reader per connection
  instead of a watcher task per request saved ~50 µs of CPU per request);
* nothing here ever cuts a streaming response that keeps moving:
  ``start``/``write``/``end`` may take as long as the handler wants;
* an exception escaping the handler becomes a generic 500 (traceback logged
  here, never sent) or, once the response has started, a closed connection;
  ``trio.Cancelled`` is never swallowed; one bad client never takes the server
  down;
* graceful shutdown: stop accepting, close idle keep-alive connections, let
  in-flight requests finish (their connections close afterwards).

All error responses produced by this layer go through the caller's
``render_error`` so the OpenAI listener answers with its envelope.

Requests are parsed by ``iopd.http.h1.RequestReader`` (a fresh one per
request, fed what was left over from the previous one) and responses are
rendered here.  Both used to be h11, which cost ~37 µs to parse a request head
and ~45 µs to send one SSE head on this machine (more on a cold CPU), most of
it generality this server does not need.  The reader is as strict as h11 was
where it matters on a public listener (one Host, one framing, token names, no
folding, no control characters), and the shapes written are few: a whole
response with ``Content-Length``, or a streamed one, chunked on HTTP/1.1 and
close-delimited on HTTP/1.0.  Header names and values are checked on the way
out too (a relayed header can never split the response).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate

import trio

from iopd.errors import (
    GatewayError,
    HeadersTooLarge,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    RequestTooLarge,
)
from iopd.http.h1 import H1ProtocolError, RequestHead, RequestReader, render_response_head
from iopd.transport import fastsend

log = logging.getLogger("iopd.http.server")

#: Bytes asked of the socket per ``receive_some``.
RECEIVE_SIZE = 65536
#: Pipelined bytes buffered while a handler runs; beyond this the reader stops
#: reading (TCP backpressure) until the handler is done.
PIPELINE_BUFFER_CAP = 65536
#: After an error response sent before the request was fully read, keep
#: draining the client's bytes this long (and at most this much) so the close
#: does not turn into a reset that destroys the response in flight.
LINGER_SECONDS = 1.0
LINGER_MAX_BYTES = 1024 * 1024
#: accept() errors that mean "out of resources": wait and retry, like trio does.
_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Size limits (bytes) and timeouts (seconds) of one listener."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    idle_timeout: float = 30.0
    #: Connections served at once; past it new ones wait in the listen backlog.
    max_connections: int = 4096
    #: Request-body bytes being received at once, all connections together.
    max_inflight_body_bytes: int = 256 * 1024 * 1024
    #: A response write that makes no progress this long cuts the connection.
    send_timeout: float = 30.0


@dataclass(slots=True)
class Request:
    """One parsed request with its complete body.  Header names are lower-case."""

    method: str
    target: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    client: tuple[str, int] | None
    http_version: str
    #: What the server's ``head_check`` returned for this request (None without one).
    context: object = None

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None


class _SendStalled(Exception):
    """No byte of a write was taken by the kernel for ``send_timeout`` seconds."""


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


Handler = Callable[[Request, "Responder"], Awaitable[None]]
ErrorRenderer = Callable[[GatewayError], tuple[int, list[tuple[str, str]], bytes]]
#: The head hook: ``(method, path, headers) -> context``, called once a request
#: head is parsed and before any body byte is read or ``100 Continue`` sent.
#: It raises a ``GatewayError`` to refuse the request, having logged and
#: counted the refusal itself (the server answers it, without ``on_reject``,
#: and closes the connection); what it returns is ``Request.context``.
#: Synchronous: it decides from what is in hand, it never waits.
HeadCheck = Callable[[str, str, list[tuple[str, str]]], object]
#: Called for every request this layer refuses itself: the status answered,
#: the error, and the head hook's context when the hook had admitted the
#: request (None when there is no hook or the head was not read).
RejectHook = Callable[[int, GatewayError, object], None]

_date_second = -1
_date_value = ""

#: Framing headers are this module's: a handler's are dropped from a streamed head.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_CHUNKED_END = b"0\r\n\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_OVERLOADED = "the server is receiving too many request bodies at once; retry later"


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
        "keep_alive",
        "started",
        "finished",
    )

    def __init__(
        self,
        conn: _Connection,
        head_only: bool,
        scope: trio.CancelScope,
        *,
        keep_alive: bool = True,
        chunked: bool = True,
    ) -> None:
        self._conn = conn
        self._head_only = head_only
        self._scope = scope
        # Bytes produced with ``hold=True`` and not written yet: they go out
        # with the next unheld write (one send instead of several).
        self._held = b""
        # Streamed bodies: chunked (HTTP/1.1) or delimited by the close (HTTP/1.0).
        self._chunked = chunked
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
        out = [("server", conn.server.server_header), ("date", _http_date())]
        out += headers
        out += framing
        if conn.server.closing:
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
        headers = [(k, v) for k, v in headers if k.lower() not in _FRAMING_HEADERS]
        if self._chunked:
            framing = [("transfer-encoding", "chunked")]
        else:
            framing = []
            self.keep_alive = False  # the close ends the body
        await self._emit(self._head(status, headers, framing), hold)

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


class HttpServer:
    """Serves ``handler`` on TCP listeners, with graceful shutdown.

    ``await nursery.start(server.serve, host, port)`` returns ``(host, port)``
    as bound.  ``shutdown()`` stops accepting, closes idle keep-alive
    connections and lets in-flight requests finish; ``serve`` returns once the
    last connection is closed.  Put a deadline around it to bound the drain.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        limits: HttpLimits,
        render_error: ErrorRenderer,
        allow_peer: Callable[[str], bool] | None = None,
        server_header: str = "iopd",
        on_reject: RejectHook | None = None,
        head_check: HeadCheck | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.render_error = render_error
        self.allow_peer = allow_peer
        self.server_header = server_header
        #: See :data:`RejectHook`.
        self.on_reject = on_reject
        #: See :data:`HeadCheck`.
        self.head_check = head_check
        self.closing = False
        self._in_flight = 0
        self._body_bytes = 0  # reserved by the bodies being received now
        self._connection_slots = trio.Semaphore(limits.max_connections)
        self._idle = trio.Event()
        self._idle.set()
        self._accept_scope: trio.CancelScope | None = None
        self._connections: set[_Connection] = set()

    @property
    def in_flight(self) -> int:
        """Requests being read, handled or answered now (idle connections excluded)."""
        return self._in_flight

    @property
    def open_connections(self) -> int:
        """Connections currently served."""
        return len(self._connections)

    @property
    def inflight_body_bytes(self) -> int:
        """Request-body bytes reserved by the bodies being received now (0 when none is)."""
        return self._body_bytes

    def _reserve_body(self, size: int) -> bool:
        """Count ``size`` more body bytes as being received; False past the limit."""
        total = self._body_bytes + size
        if total > self.limits.max_inflight_body_bytes:
            return False
        self._body_bytes = total
        return True

    async def wait_idle(self) -> None:
        """Return once no request is in flight (see :attr:`in_flight`)."""
        while self._in_flight:
            await self._idle.wait()

    def _request_started(self) -> None:
        if self._in_flight == 0:
            self._idle = trio.Event()
        self._in_flight += 1

    def _request_done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def shutdown(self) -> None:
        """Stop accepting, close idle connections, close the rest after their response."""
        self.closing = True
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        for conn in list(self._connections):
            conn.close_if_idle()

    async def serve(
        self,
        host: str,
        port: int,
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0 picks a port) until shut down or cancelled."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound_port = int(listeners[0].socket.getsockname()[1])
        try:
            async with trio.open_nursery() as connections:
                with trio.CancelScope() as accept_scope:
                    self._accept_scope = accept_scope
                    if self.closing:
                        accept_scope.cancel()
                    async with trio.open_nursery() as acceptors:
                        for listener in listeners:
                            acceptors.start_soon(self._accept_loop, listener, connections)
                        task_status.started((host, bound_port))
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        # At ``max_connections`` the loop stops accepting: new connections wait
        # in the kernel's listen backlog (backpressure that costs nothing here)
        # until one closes and ``_handle_connection`` gives its slot back.
        slots = self._connection_slots
        while True:
            await slots.acquire()
            try:
                stream = await listener.accept()
            except OSError as exc:
                slots.release()
                if exc.errno in _ACCEPT_RETRY_ERRNOS:
                    log.error("event=accept_failed error=%r retry_s=0.1", str(exc))
                    await trio.sleep(0.1)
                    continue
                raise
            except BaseException:
                slots.release()
                raise
            connections.start_soon(self._handle_connection, stream)

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        conn: _Connection | None = None
        try:
            try:
                peer = stream.socket.getpeername()
            except OSError:
                return
            client = (str(peer[0]), int(peer[1]))
            if self.allow_peer is not None and not self.allow_peer(client[0]):
                log.warning("event=connection_refused client=%s reason=peer_filter", client[0])
                return
            conn = _Connection(self, stream, client)
            self._connections.add(conn)
            await conn.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer reset or closed the connection: nothing to answer
        except* Exception as group:
            log.error("event=connection_error", exc_info=group)
        finally:
            if conn is not None:
                self._connections.discard(conn)
            self._connection_slots.release()
            await trio.aclose_forcefully(stream)


class _Connection:
    """One client connection: request loop, limits, handler, disconnect detection.

    A reader task owns the socket's receive side for the connection's whole
    life: it moves bytes into ``pending`` (bounded: at the cap it stops reading,
    which is TCP backpressure) and wakes the request loop.  Because a receive
    is (almost) always outstanding, EOF or a reset is seen at once, also while
    a handler runs, and cancels that handler.  Only the request loop touches
    the parser.

    After handing bytes over, the reader waits until the loop releases it
    (``_release_reader``: the loop needs more bytes, or its handler starts)
    before it receives again: re-arming the receive (a failed ``recv`` and a
    poller update) then happens while the handler waits, not between a
    request's arrival and its parsing.
    """

    __slots__ = (
        "server",
        "stream",
        "client",
        "reader",
        "idle_scope",
        "handler_scope",
        "reading",
        "pending",
        "eof",
        "discard",
        "active",
        "keep_alive",
        "torn",
        "context",
        "refused_at_head",
        "reserved",
        "_loop_waiter",
        "_space",
        "_reader_waiter",
    )

    def __init__(self, server: HttpServer, stream: trio.SocketStream, client: tuple[str, int]):
        self.server = server
        self.stream = stream
        self.client = client
        self.reader = RequestReader(server.limits.max_header_bytes)
        self.idle_scope: trio.CancelScope | None = None
        self.handler_scope: trio.CancelScope | None = None
        self.reading = "headers"  # what a 408 says was too slow
        self.pending = bytearray()
        self.eof = False  # the client closed (or reset) its side
        self.discard = False  # lingering close: drop what still arrives
        self.active = False  # a request is being read or answered
        self.keep_alive = False  # the request now served allows another after it
        self.torn = False  # a write was cut halfway: the connection must close
        self.context: object = None  # the head hook's answer for the request now read
        self.refused_at_head = False  # the head hook refused it (and accounted for that)
        self.reserved = 0  # body bytes this request holds of the server's in-flight budget
        self._loop_waiter: trio.lowlevel.Task | None = None
        self._space: trio.Event | None = None
        self._reader_waiter: trio.lowlevel.Task | None = None  # reader parked after a handover

    def _next_cycle(self) -> None:
        """A fresh parser for the next request, fed what arrived after this one."""
        leftover = self.reader.leftover()
        self.reader = RequestReader(self.server.limits.max_header_bytes)
        if leftover:
            self.reader.receive_data(leftover)

    def close_if_idle(self) -> None:
        """Shutdown: end the connection if it waits for a next request."""
        if self.idle_scope is not None:
            self.idle_scope.cancel()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_loop)
            try:
                while await self._serve_one():
                    self._next_cycle()
            finally:
                nursery.cancel_scope.cancel()

    # ------------------------------------------------------------ receiving

    async def _read_loop(self) -> None:
        stream = self.stream
        discarded = 0
        try:
            while True:
                if len(self.pending) >= PIPELINE_BUFFER_CAP and not self.discard:
                    self._space = trio.Event()
                    await self._space.wait()
                    continue
                data = await stream.receive_some(RECEIVE_SIZE)
                if not data:
                    break
                if self.discard:
                    discarded += len(data)
                    if discarded > LINGER_MAX_BYTES:
                        break
                else:
                    self.pending += data
                    if self._loop_waiter is not None:
                        # Hand over, and re-arm only once the loop lets go.
                        self._wake_loop()
                        self._reader_waiter = trio.lowlevel.current_task()
                        await trio.lowlevel.wait_task_rescheduled(self._abort_reader_wait)
                        continue
                self._wake_loop()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.eof = True
        if self.handler_scope is not None:
            self.handler_scope.cancel()
        self._wake_loop()

    def _wake_loop(self) -> None:
        task = self._loop_waiter
        if task is not None:
            self._loop_waiter = None
            trio.lowlevel.reschedule(task)

    def _abort_reader_wait(self, _: object) -> trio.lowlevel.Abort:
        self._reader_waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _release_reader(self) -> None:
        """Let the reader receive again (it waits after handing bytes over)."""
        task = self._reader_waiter
        if task is not None:
            self._reader_waiter = None
            trio.lowlevel.reschedule(task)

    def _abort_wait(self, _: object) -> trio.lowlevel.Abort:
        self._loop_waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _wait_for_reader(self) -> None:
        self._release_reader()
        self._loop_waiter = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort_wait)

    async def _receive(self) -> bytes:
        """The client's next bytes (everything buffered); b"" once it closed."""
        while not self.pending:
            if self.eof:
                return b""
            await self._wait_for_reader()
        data = bytes(self.pending)
        self.pending.clear()
        if self._space is not None:
            self._space.set()
            self._space = None
        return data

    # -------------------------------------------------------------- sending

    async def send_bytes(self, data: bytes, scope: trio.CancelScope | None) -> None:
        """Write to the client; a broken connection cancels ``scope``.

        A write interrupted after its first byte (a cancel while the socket
        was full) leaves the connection ``torn``: half a piece is on the
        wire, so nothing may be written after it and the connection closes.
        """
        if self.torn:
            raise AbortResponse("an earlier write to the client was cut halfway")
        await trio.lowlevel.checkpoint_if_cancelled()  # a cut here leaves nothing behind
        try:
            written = fastsend.write_now(self.stream, data)
            if written < len(data):
                self.torn = True  # until the rest is out
                await self._send_rest(data, written)
                self.torn = False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.eof = True
            if scope is not None:
                scope.cancel()
            raise ClientDisconnected("client disconnected") from None
        except _SendStalled:
            log.info(
                "event=send_timeout client=%s timeout_s=%s",
                self.client[0],
                self.server.limits.send_timeout,
            )
            self.eof = True  # given up on: the connection closes
            if scope is not None:
                scope.cancel()
            raise ClientDisconnected("client stopped reading") from None

    async def _send_rest(self, data: bytes, written: int) -> None:
        """Write ``data[written:]`` as the socket takes it; raise :class:`_SendStalled`
        when it takes nothing for ``send_timeout`` seconds.

        The timer restarts whenever the kernel takes bytes: a slow reader that
        keeps reading is never cut, one that stopped is, whatever the size.
        (trio sets ``TCP_NOTSENT_LOWAT`` on its sockets, so the kernel holds
        little unsent data and has room again as soon as the caller's TCP
        acknowledges some: room is progress of the caller, not of a buffer.)
        """
        timeout = self.server.limits.send_timeout
        view = memoryview(data)[written:]
        stream = self.stream
        if type(stream) is not trio.SocketStream:  # not a plain socket: no progress to see
            with trio.move_on_after(timeout):
                await stream.send_all(view)
                return
            raise _SendStalled
        sock = stream.socket
        while view:
            with trio.move_on_after(timeout):
                try:
                    sent = await sock.send(view)  # waits for room, then takes what fits
                except OSError as exc:
                    raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
                view = view[sent:]
                continue
            raise _SendStalled

    # ------------------------------------------------------------- requests

    async def _serve_one(self) -> bool:
        """Serve one request; True when the connection may carry another."""
        try:
            return await self._serve_request()
        finally:
            if self.active:
                self.active = False
                self.server._request_done()

    def _begin_request(self) -> None:
        """The next request's first bytes are here: it counts as in flight."""
        self.active = True
        self.server._request_started()

    async def _serve_request(self) -> bool:
        result: Request | GatewayError | None = None
        self.context = None
        self.refused_at_head = False
        # One scope per request whose deadline moves with the phase (idle ->
        # head -> body): cheaper than a scope per phase on the hot path.
        with trio.CancelScope() as deadline:
            try:
                result = await self._read_request(deadline)
            except H1ProtocolError as exc:
                result = _protocol_error(exc)
            except ClientDisconnected:
                result = None
            finally:
                if self.reserved:  # the body is in (or given up on): no longer arriving
                    self.server._body_bytes -= self.reserved
                    self.reserved = 0
        if deadline.cancelled_caught:
            if self.idle_scope is not None:  # idle timeout or shutdown: close quietly
                self.idle_scope = None
                return False
            result = RequestTimeout(f"request {self.reading} not received in time")
        if result is None:
            return False
        if isinstance(result, GatewayError):
            await self._fail(result)
            return False
        return await self._run_handler(result)

    async def _read_request(self, deadline: trio.CancelScope) -> Request | GatewayError | None:
        """Read one request under ``deadline``; None means close quietly."""
        reader = self.reader
        limits = self.server.limits
        if self.pending:  # pipelined bytes that arrived during the last response
            reader.receive_data(await self._receive())
        head = reader.read_head()
        if head is None:
            if not reader.buffered:
                # Between requests: wait for the first byte of the next one.
                if self.server.closing:
                    return None
                deadline.deadline = trio.current_time() + limits.idle_timeout
                self.idle_scope = deadline
                data = await self._receive()
                self.idle_scope = None
                if not data:
                    return None
                reader.receive_data(data)
                head = reader.read_head()
            self._begin_request()
            if head is None:
                self.reading = "headers"
                deadline.deadline = trio.current_time() + limits.header_timeout
                while head is None:
                    data = await self._receive()
                    if not data:
                        reader.receive_eof()  # closed inside the head: a 400
                        head = reader.read_head()
                        if head is None:
                            return None  # (only blank lines had come)
                        break
                    reader.receive_data(data)
                    head = reader.read_head()
        if not self.active:
            self._begin_request()
        target = head.target
        path, _, query = target.partition("?")
        refusal = self._admit(head, path)
        if refusal is not None:
            return refusal

        if head.expect_continue and not reader.complete:
            await self.send_bytes(_CONTINUE, None)
        body_parts: list[bytes] = []
        size = 0
        waited = False
        counted = head.content_length is None  # chunked: reserve each piece as it comes
        while True:
            part = reader.read_body()
            if part:
                size += len(part)
                if size > limits.max_body_bytes:
                    return RequestTooLarge("request body too large")
                if counted:
                    if not self.server._reserve_body(len(part)):
                        return Overloaded(_OVERLOADED)
                    self.reserved += len(part)
                body_parts.append(part)
            if reader.complete:
                break
            if not waited:
                waited = True
                self.reading = "body"
                deadline.deadline = trio.current_time() + limits.body_timeout
            data = await self._receive()
            if not data:
                reader.receive_eof()  # read_body raises: closed inside the body, a 400
            reader.receive_data(data)

        self.keep_alive = head.keep_alive
        return Request(
            method=head.method,
            target=target,
            path=path,
            query=query,
            headers=head.headers,
            body=body_parts[0] if len(body_parts) == 1 else b"".join(body_parts),
            client=self.client,
            http_version=head.http_version,
            context=self.context,
        )

    def _admit(self, head: RequestHead, path: str) -> GatewayError | None:
        """Everything decided from the head, before a body byte is read: the head
        hook (route, method, caller), the declared size, the in-flight body budget."""
        server = self.server
        if server.head_check is not None:
            try:
                self.context = server.head_check(head.method, path, head.headers)
            except GatewayError as exc:
                self.refused_at_head = True
                return exc
            except Exception:
                log.exception("event=callback_failed component=http callback=head_check")
                return GatewayError("Internal server error")
        length = head.content_length
        if length:
            if length > server.limits.max_body_bytes:
                return RequestTooLarge("request body too large")
            if not server._reserve_body(length):
                return Overloaded(_OVERLOADED)
            self.reserved = length
        return None

    async def _run_handler(self, request: Request) -> bool:
        server = self.server
        handler_scope = trio.CancelScope()
        http11 = request.http_version == "1.1"
        responder = Responder(
            self,
            request.method == "HEAD",
            handler_scope,
            keep_alive=self.keep_alive,
            chunked=http11,
        )
        crashed: BaseException | None = None
        if self.eof:
            return False  # the client is already gone
        self.handler_scope = handler_scope
        self._release_reader()  # watch for a disconnect while the handler runs
        try:
            with handler_scope:
                try:
                    await server.handler(request, responder)
                except* ClientDisconnected:
                    pass
                except* GatewayError as group:
                    crashed = group.exceptions[0]
                except* AbortResponse as group:
                    crashed = group.exceptions[0]
                except* Exception as group:
                    log.error(
                        "event=handler_failed method=%s path=%s",
                        request.method,
                        request.path,
                        exc_info=group,
                    )
                    crashed = group
        finally:
            self.handler_scope = None

        if handler_scope.cancelled_caught or self.eof or self.torn:
            return False
        try:
            if not responder.started:
                if isinstance(crashed, GatewayError):
                    error: GatewayError = crashed
                elif crashed is not None:
                    error = GatewayError("Internal server error")
                else:
                    log.error(
                        "event=handler_no_response method=%s path=%s", request.method, request.path
                    )
                    error = GatewayError("Internal server error")
                await self._send_error(error, responder)
            elif crashed is not None:
                await responder.flush()  # what was held back, as if written at once
                return False  # cannot report an error mid-response: cut it
            elif not responder.finished:
                await responder.end()
        except ClientDisconnected:
            return False
        return responder.finished and responder.keep_alive and not server.closing

    # --------------------------------------------------------------- errors

    def _render(self, error: GatewayError) -> tuple[int, list[tuple[str, str]], bytes]:
        try:
            return self.server.render_error(error)
        except Exception:
            log.exception("event=render_error_failed")
            return 500, [("content-type", "text/plain")], b"internal server error\n"

    async def _send_error(self, error: GatewayError, responder: Responder) -> None:
        status, headers, body = self._render(error)
        await responder.send(status, headers, body)

    async def _fail(self, error: GatewayError) -> None:
        """Answer a request this layer refuses, then close gracefully.

        A refusal by the head hook was logged and counted by the hook; every
        other one is logged here and reported to ``on_reject``.
        """
        status, headers, body = self._render(error)
        if not self.refused_at_head:
            log.info(
                "event=request_rejected status=%d code=%s client=%s",
                status,
                error.code,
                self.client[0] if self.client else "-",
            )
            if self.server.on_reject is not None:
                try:
                    self.server.on_reject(status, error, self.context)
                except Exception:
                    log.exception("event=callback_failed component=http callback=on_reject")
        head = [("server", self.server.server_header), ("date", _http_date())]
        head += headers
        head += [("content-length", str(len(body))), ("connection", "close")]
        try:
            data = render_response_head(status, head) + body
        except H1ProtocolError:
            return
        try:
            await self._send_rest(data, 0)
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, _SendStalled):
            return
        # Keep draining what the client still sends until it closes, so that
        # closing does not reset the connection before it read the response.
        self.discard = True
        self.pending.clear()
        if self._space is not None:
            self._space.set()
        with trio.move_on_after(LINGER_SECONDS):
            while not self.eof:
                await self._wait_for_reader()


def _protocol_error(exc: H1ProtocolError) -> GatewayError:
    """The answer to a request the parser refused, by its ``status_hint``."""
    from iopd.errors import MethodNotAllowed, NotImplementedByEdge

    if exc.status_hint == 431:
        return HeadersTooLarge("request headers too large")
    if exc.status_hint == 405:
        return MethodNotAllowed(str(exc))
    if exc.status_hint == 501:
        return NotImplementedByEdge(str(exc))
    return InvalidRequest(f"malformed HTTP request: {exc}")


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: HttpLimits,
    render_error: ErrorRenderer,
    allow_peer: Callable[[str], bool] | None = None,
    server_header: str = "iopd",
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``host:port``; ``task_status.started((host, bound_port))``.

    When ``shutdown`` is set the server stops accepting, closes idle
    connections, lets in-flight requests finish and then returns.  Cancel the
    caller's scope to stop at once.
    """
    server = HttpServer(
        handler,
        limits=limits,
        render_error=render_error,
        allow_peer=allow_peer,
        server_header=server_header,
    )
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.serve, host, port)
        if shutdown is not None:
            nursery.start_soon(_shutdown_when_set, shutdown, server)
        task_status.started(bound)


async def _shutdown_when_set(event: trio.Event, server: HttpServer) -> None:
    await event.wait()
    server.shutdown()
