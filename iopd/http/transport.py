"""The trio side of one server connection, around its sans-IO state machine.

``iopd.http.connection`` decides; this module does the I/O it asks for:
receive under the deadline the state names, write ``100 Continue``, run the
handler in a cancel scope, answer a refusal and linger, write responses with
a bound on stalls (``send_timeout``).

Who receives (measured): the request loop reads the request itself, so
the task that wakes on a request's bytes parses it and runs its handler in
the same step (when a separate reader handed the bytes over, that cost a
scheduler round between a request's arrival and its parsing, on every
request's critical path).  While a handler runs, the server's
``ClientWatch`` (one task per server, ``client_watch.py``) watches the
socket, so EOF or a reset is seen at once and cancels the handler; it
buffers what a client pipelines meanwhile.  When the handler is done the
loop takes the socket back: the socket leaves the watch set synchronously,
so no bytes can be read for it after that.  (A task per request, then one
watcher task per connection parked between handlers, cost two task steps
and a cancel scope per request; the shared watch costs two ``epoll_ctl``.)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from iopd.http.client_watch import ClientWatch
from iopd.http.connection import (
    LINGER_MAX_BYTES,
    LINGER_SECONDS,
    ConnState,
    HeadContext,
    HttpConnection,
    ListenerState,
    Refuse,
    Request,
    Signal,
    context_headers,
)
from iopd.http.errors import Refusal, Rendered, internal_error
from iopd.http.h1 import H1ProtocolError
from iopd.http.responder import AbortResponse, ClientDisconnected, Responder
from iopd.transport import fastsend

log = logging.getLogger("iopd.http.server")  # one logger name for the whole server

#: Bytes asked of the socket per ``receive_some``.
RECEIVE_SIZE = 65536
#: Pipelined bytes buffered while a handler runs; beyond this the reader stops
#: reading (TCP backpressure) until the handler is done.
PIPELINE_BUFFER_CAP = 65536
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_IDLE = ConnState.IDLE
_NEED_DATA = Signal.NEED_DATA
_SEND_CONTINUE = Signal.SEND_CONTINUE
_CLOSE = Signal.CLOSE


class _Ran:
    """What a handler's run leaves for the response's end: its responder, and
    the exception it ended with (with the owner's refusal in it, if any)."""

    __slots__ = ("responder", "crashed", "refusal")

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.crashed: BaseException | None = None
        self.refusal: Refusal | None = None


class _SendStalled(Exception):
    """No byte of a write was taken by the kernel for ``send_timeout`` seconds."""


Handler = Callable[[Request, Responder], Awaitable[None]]
#: Renders a refusal (this layer's ``HttpError`` or the owner's own error) as
#: ``(status, headers, body)``; the second argument is the head hook's context
#: of the refused request (None when the hook did not admit it), so the owner
#: can shape the error by route.
ErrorRenderer = Callable[[Refusal, HeadContext | None], Rendered]
#: Called for every request this layer refuses itself: the status answered,
#: the error (an ``iopd.http.errors.HttpError``), and the head hook's context
#: when the hook had admitted the request (None when there is no hook or the
#: head was not read).  Refusals by the head hook are not reported: the hook
#: counted them.
RejectHook = Callable[[int, Refusal, HeadContext | None], None]


class ConnectionOwner(Protocol):
    """What a connection needs of its server (``iopd.http.server.HttpServer``)."""

    handler: Handler
    render_error: ErrorRenderer
    on_reject: RejectHook | None
    listener: ListenerState
    server_header: str

    @property
    def closing(self) -> bool:
        """True once the server is shutting down."""

    def request_started(self) -> None:
        """A request's first bytes are in: it counts as in flight."""

    def request_done(self) -> None:
        """The request was answered, refused or given up on."""


class ServedConnection:
    """The trio side of one client connection: its request loop, deadlines,
    handler and writes, around an :class:`~iopd.http.connection.HttpConnection`.

    The request loop receives while it reads a request (under the deadline
    the state machine names); while a handler runs, the server's
    ``ClientWatch`` does, moving bytes into ``pending`` (bounded: at the cap
    it stops reading, which is TCP backpressure).  A receive is always
    outstanding, so EOF or a reset is seen at once, also while a handler
    runs, and cancels that handler.  Only the request loop feeds the state
    machine.
    """

    __slots__ = (
        "server",
        "listener",
        "stream",
        "client",
        "http",
        "idle_scope",
        "handler_scope",
        "pending",
        "eof",
        "active",
        "torn",
        "_unsent",
        "_watch",
        "_watched_fd",
    )

    def __init__(
        self,
        server: ConnectionOwner,
        stream: trio.SocketStream,
        client: tuple[str, int],
        watch: ClientWatch,
    ):
        self.server = server
        self.listener = server.listener
        self.stream = stream
        self.client = client
        self.http = HttpConnection(server.listener, client)
        self.idle_scope: trio.CancelScope | None = None  # set while waiting in IDLE
        self.handler_scope: trio.CancelScope | None = None
        self.pending = bytearray()
        self.eof = False  # the client closed (or reset) its side
        self.active = False  # a request is being read or answered (counted in flight)
        self.torn = False  # a write was cut halfway: the connection must close
        # The rest of a ``send_now`` the kernel took only part of: the next
        # ``send_bytes`` writes it first (the connection is torn until then).
        self._unsent: bytes | None = None
        self._watch = watch  # the server's (its listener's) watch
        # The socket's number while the server's watch reads it (a handler
        # runs and ``pending`` is under its cap); -1 when the loop owns it.
        self._watched_fd = -1

    def close_if_idle(self) -> None:
        """Shutdown: end the connection if it waits for a next request."""
        if self.idle_scope is not None:
            self.idle_scope.cancel()

    async def run(self) -> None:
        try:
            while await self._serve_one():
                pass
        finally:
            self._stop_watch()  # before the socket is closed
            self.http.close()  # gives back a body reservation when cancelled mid-body

    # ------------------------------------------------------------ receiving

    async def _receive(self) -> bytes:
        """The client's next bytes (request loop only, no handler running):
        what the watcher buffered during the last response, else one read of
        the socket; b"" once the client closed."""
        if self.pending:
            return self._take_pending()
        if self.eof:
            return b""
        try:
            data = await fastsend.receive_some(self.stream, RECEIVE_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if not data:
            self.eof = True
        return data

    def _take_pending(self) -> bytes:
        data = bytes(self.pending)
        self.pending.clear()
        return data

    def _start_watch(self) -> None:
        """A handler starts: the server's watch takes over the socket's receive side."""
        if self.eof or len(self.pending) >= PIPELINE_BUFFER_CAP:
            return  # nothing more to learn, or backpressure until the loop reads
        try:
            fd = self.stream.socket.fileno()
            self._watch.watch(fd, self._on_readable)
        except OSError:  # closed under us: as a client gone
            self.eof = True
            if self.handler_scope is not None:
                self.handler_scope.cancel()
            return
        self._watched_fd = fd

    def _stop_watch(self) -> None:
        """The handler is done (or the cap is reached): the loop owns the socket again."""
        fd = self._watched_fd
        if fd >= 0:
            self._watched_fd = -1
            self._watch.unwatch(fd)

    def _on_readable(self) -> None:
        """The watch saw the socket readable while a handler runs: buffer what the
        client pipelines (up to the cap: beyond it, TCP backpressure), or at EOF
        or a reset cancel the handler."""
        fd = self._watched_fd
        if fd < 0:  # pragma: no cover - unwatched before the watch looked
            return
        try:
            data = fastsend.read_ready(self.stream, RECEIVE_SIZE, fd)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
        if data is None:
            return  # a spurious wake-up
        if not data:
            self._stop_watch()
            self.eof = True
            if self.handler_scope is not None:
                self.handler_scope.cancel()
            return
        self.pending += data
        if len(self.pending) >= PIPELINE_BUFFER_CAP:
            self._stop_watch()

    # -------------------------------------------------------------- sending

    async def send_bytes(self, data: bytes, scope: trio.CancelScope | None) -> None:
        """Write to the client; a broken connection cancels ``scope``.

        A write interrupted after its first byte (a cancel while the socket
        was full) leaves the connection ``torn``: half a piece is on the
        wire, so nothing may be written after it and the connection closes.
        """
        unsent = self._unsent
        if unsent is not None:  # the rest of a ``send_now`` goes first
            self._unsent = None
            data = unsent + data
        elif self.torn:
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
                self.listener.limits.send_timeout,
            )
            self.eof = True  # given up on: the connection closes
            if scope is not None:
                scope.cancel()
            raise ClientDisconnected("client stopped reading") from None

    @property
    def unsent(self) -> bool:
        """Part of a ``send_now`` is still to be written (by ``send_bytes``)."""
        return self._unsent is not None

    def send_now(self, data: bytes) -> bool:
        """Write ``data`` without awaiting, from any task, while the handler is
        parked between two writes; False (nothing written) when it cannot.

        For a producer that runs in another task (the edge's wire reader
        relaying a chunk): the bytes leave without waking the handler.  When
        the kernel takes only part, the rest is kept, the connection is torn
        until the handler's next ``send_bytes`` writes it (under
        ``send_timeout``), and True is returned: the caller must make the
        handler do that write (``Responder.send_unsent``).  A broken or
        closing connection, or a cancelled handler, gets False: the handler's
        own write finds out what happened.
        """
        if self.torn or self.eof:
            return False
        scope = self.handler_scope
        if scope is not None and scope.cancel_called:
            return False
        try:
            written = fastsend.write_now(self.stream, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        if written == 0:
            return False
        if written < len(data):
            self._unsent = data[written:]
            self.torn = True
        return True

    async def _send_rest(self, data: bytes, written: int) -> None:
        """Write ``data[written:]`` as the socket takes it; raise :class:`_SendStalled`
        when it takes nothing for ``send_timeout`` seconds.

        The timer restarts whenever the kernel takes bytes: a slow reader that
        keeps reading is never cut, one that stopped is, whatever the size.
        (trio sets ``TCP_NOTSENT_LOWAT`` on its sockets, so the kernel holds
        little unsent data and has room again as soon as the caller's TCP
        acknowledges some: room is progress of the caller, not of a buffer.)
        """
        timeout = self.listener.limits.send_timeout
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
                self.server.request_done()

    async def _serve_request(self) -> bool:
        http = self.http
        event: Request | Refuse | Signal = _CLOSE
        # One scope per request: its deadline moves to the one the state
        # machine names as it reads (idle -> head -> body), and the handler
        # runs in it with no deadline (a client gone cancels it).  Cheaper
        # on the hot path than a scope per state, or one to read and one to
        # handle.
        ran: _Ran | None = None
        with trio.CancelScope() as scope:
            try:
                event = await self._read_request(scope)
            except ClientDisconnected:  # while writing 100 Continue
                event = _CLOSE
            if isinstance(event, Request) and not self.eof and not scope.cancel_called:
                scope.deadline = math.inf
                ran = _Ran(self._responder(event, scope))
                await self._run_handler(event, ran, scope)
        if isinstance(event, Request):
            if ran is None:
                if self.eof:
                    return http.finish_response(False)  # the client is already gone
                # The read's deadline ran out in the very round its last
                # bytes came (its cancel is pending, not raised): the
                # complete request is served, in a scope of its own.
                scope = trio.CancelScope()
                ran = _Ran(self._responder(event, scope))
                with scope:
                    await self._run_handler(event, ran, scope)
            return await self._after_handler(event, scope, ran)
        if scope.cancelled_caught:
            self.idle_scope = None
            event = http.timed_out()
        if isinstance(event, Refuse):
            await self._refuse(event)
        http.close()
        return False

    async def _read_request(self, deadline: trio.CancelScope) -> Request | Refuse | Signal:
        """Feed the state machine until it has a request, a refusal or a close."""
        http = self.http
        self._stop_watch()  # (the last response is out: the socket is the loop's)
        if self.pending:  # pipelined bytes that arrived during the last response
            http.receive_pipelined(self._take_pending())
        armed: ConnState | None = None
        while True:
            event = http.next_event()
            if not self.active and event is not _CLOSE and http.state is not _IDLE:
                self.active = True  # the request's first bytes are here: in flight
                self.server.request_started()
            if event is _NEED_DATA:
                state = http.state
                if state is not armed:  # each state's deadline runs from its start
                    armed = state
                    deadline.deadline = trio.current_time() + http.timeout
                if state is _IDLE:
                    self.idle_scope = deadline  # shutdown may end this wait
                    data = await self._receive()
                    self.idle_scope = None
                else:
                    data = await self._receive()
                if data:
                    http.receive_data(data)
                else:
                    http.receive_eof()
            elif event is _SEND_CONTINUE:
                await self.send_bytes(_CONTINUE, None)
            else:
                return event

    def _responder(self, request: Request, scope: trio.CancelScope) -> Responder:
        return Responder(
            self,
            request.method == "HEAD",
            scope,
            keep_alive=self.http.keep_alive,
            chunked=request.http_version == "1.1",
            extra_headers=context_headers(request.context),
        )

    async def _run_handler(self, request: Request, ran: _Ran, scope: trio.CancelScope) -> None:
        """Run the handler in the request's ``scope`` (a disconnect cancels it),
        noting in ``ran`` how it ended for :meth:`_after_handler`, which runs
        outside the scope."""
        self.handler_scope = scope
        self._start_watch()  # a disconnect cancels the handler
        try:
            await self.server.handler(request, ran.responder)
        except* ClientDisconnected:
            pass
        except* AbortResponse as group:
            ran.crashed = group.exceptions[0]
        except* Exception as group:
            ran.crashed = group
            ran.refusal = _owner_refusal(group)
            if ran.refusal is None:
                log.error(
                    "event=handler_failed method=%s path=%s",
                    request.method,
                    request.path,
                    exc_info=group,
                )
        finally:
            self.handler_scope = None

    async def _after_handler(self, request: Request, scope: trio.CancelScope, ran: _Ran) -> bool:
        """The response's end, or the error a handler that wrote nothing left;
        True when the connection may carry another request."""
        http, responder, crashed = self.http, ran.responder, ran.crashed
        if scope.cancelled_caught or self.eof or self.torn:
            return http.finish_response(False)
        try:
            if not responder.started:
                if crashed is None:
                    log.error(
                        "event=handler_no_response method=%s path=%s", request.method, request.path
                    )
                error = ran.refusal if ran.refusal is not None else internal_error()
                status, headers, body = self._render(error, request.context)
                await responder.send(status, headers, body)
            elif crashed is not None:
                await responder.flush()  # what was held back, as if written at once
                return http.finish_response(False)  # cannot report an error mid-response
            elif not responder.finished:
                await responder.end()
        except ClientDisconnected:
            return http.finish_response(False)
        return http.finish_response(responder.finished and responder.keep_alive)

    # --------------------------------------------------------------- errors

    def _render(self, error: Refusal, context: HeadContext | None) -> Rendered:
        try:
            return self.server.render_error(error, context)
        except Exception:
            log.exception("event=render_error_failed")
            return 500, [("content-type", "text/plain")], b"internal server error\n"

    async def _refuse(self, refusal: Refuse) -> None:
        """Answer a request this layer refused, then linger and close.

        A refusal by the head hook was logged and counted by the hook; every
        other one is logged here and reported to ``on_reject``.
        """
        error = refusal.error
        status, headers, body = self._render(error, refusal.context)
        if not refusal.by_head_check:
            log.info(
                "event=request_rejected status=%d code=%s client=%s",
                status,
                error.code,
                self.client[0],
            )
            on_reject = self.server.on_reject
            if on_reject is not None:
                try:
                    on_reject(status, error, refusal.context)
                except Exception:
                    log.exception("event=callback_failed component=http callback=on_reject")
        responder = Responder(
            self,
            refusal.head_request,  # the answer to a HEAD carries no body
            None,
            keep_alive=False,
            extra_headers=context_headers(refusal.context),
        )
        try:
            await responder.send(status, headers, body)
            await self.stream.send_eof()
        except (
            H1ProtocolError,  # the owner rendered a header that cannot be sent
            ClientDisconnected,
            AbortResponse,  # a torn 100 Continue
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ):
            return
        # Keep draining what the client still sends until it closes, so that
        # closing does not reset the connection before it read the response.
        self.http.refusal_sent()
        self.pending.clear()
        discarded = 0
        with trio.move_on_after(LINGER_SECONDS):
            while discarded <= LINGER_MAX_BYTES:
                data = await self._receive()
                if not data:
                    break
                discarded += len(data)


def _owner_refusal(group: BaseExceptionGroup[Exception]) -> Refusal | None:
    """The owner's error a handler raised (its first), when that is all it raised."""
    refusals, rest = group.split(lambda exc: isinstance(exc, Refusal))
    if refusals is None or rest is not None:
        return None
    leaf: BaseException = refusals
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf if isinstance(leaf, Refusal) else None
