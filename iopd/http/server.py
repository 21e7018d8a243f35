"""A small HTTP/1.1 server on trio: the edge's OpenAI listener (the admin API is on hypercorn).

Why no framework: measured by ``scripts/bench_http.py --frameworks`` (the
figures are in ``docs/performance.md``), quart-trio on hypercorn's trio
worker costs several times this server's CPU per request (a plain ASGI app
on the same worker too) and left a ``Connection: close`` socket open, and
Quart cuts responses at its 60 s response timeout unless told otherwise.  The gateway's budget is <= 0.8 ms
of CPU per request for edge and node together, so the HTTP layer is written
here and kept lean: it is the hot path.

Three layers, each in its own module:

* ``iopd.http.connection``: the sans-IO state machine of a connection (IDLE,
  HEAD, BODY, HANDLER, REFUSING, LINGER, CLOSED) on the parser
  ``iopd.http.h1``.  Every decision is there: limits, the in-flight body
  budget, the head hook, which deadline applies in which state, what a
  timeout or a refusal does, whether the connection is reused.
* ``iopd.http.responder``: the one writer of responses and renderer of heads,
  for the handler's responses and this layer's refusals alike.
* ``iopd.http.transport``: the trio side of one connection: the request
  loop reading requests, one cancel scope per request (its deadlines while
  it is read, then the handler's),
  writes bounded by ``send_timeout``;
* ``iopd.http.client_watch``: the sockets of the handlers running now,
  watched by one task per listener (EOF cancels the handler, pipelined
  bytes are buffered);
* this module: listening, the accept loop (``max_connections``), a
  listener's ``ClientWatch``, requests in flight and graceful shutdown.

What it guarantees (the states are described in ``iopd.http.connection``):

* keep-alive, with ``idle_timeout`` between requests; ``Connection: close``
  (or HTTP/1.0) closes after the response;
* the head within ``header_timeout``, the body within ``body_timeout`` (else
  408); heads over ``max_header_bytes`` 431, bodies over ``max_body_bytes``
  413, malformed HTTP 400, all decided before the handler;
* decide from the head: the optional ``head_check`` (route, method, token)
  runs before any body byte is read or ``100 Continue`` sent; at most
  ``max_inflight_body_bytes`` of bodies are received at once (503
  ``overloaded``); at most ``max_connections`` connections are served (past
  it new ones wait in the kernel's listen backlog);
* a write that makes no progress for ``send_timeout`` cuts the connection
  and cancels the handler, which frees what it held (a provider slot);
* the handler gets the whole body and runs in a cancel scope cancelled when
  the client goes away (a half-close counts as gone); nothing here ever cuts
  a response that keeps moving;
* an exception escaping the handler becomes a generic 500 (traceback logged
  here, never sent) or, once the response started, a closed connection;
  ``trio.Cancelled`` is never swallowed; one bad client never takes the
  server down;
* graceful shutdown: stop accepting, close idle connections, let in-flight
  requests finish (their connections close afterwards).

Errors: this layer's refusals are ``iopd.http.errors`` (status, stable code,
message, headers); the listener's owner renders them (``render_error``) and
counts them (``on_reject``).  The owner's own errors (a head hook's refusal,
an error escaping a handler before its response) are recognised by shape
(``iopd.http.errors.Refusal``), never by importing the owner's classes.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import trio

from iopd.http.client_watch import ClientWatch
from iopd.http.connection import HeadCheck, HeadContext, HttpLimits, ListenerState, Request
from iopd.http.responder import AbortResponse, ClientDisconnected, Responder
from iopd.http.transport import ErrorRenderer, Handler, RejectHook, ServedConnection

log = logging.getLogger("iopd.http.server")

#: accept() errors that mean "out of resources": wait and retry, like trio does.
_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


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
        #: Shared by every connection: limits, the head hook, the body budget, closing.
        self.listener = ListenerState(limits, head_check)
        self._in_flight = 0
        self._connection_slots = trio.Semaphore(limits.max_connections)
        self._idle = trio.Event()
        self._idle.set()
        self._accept_scope: trio.CancelScope | None = None
        self._connections: set[ServedConnection] = set()
        self._all_closed = trio.Event()
        self._watches: set[ClientWatch] = set()  # one per listening ``serve``

    @property
    def in_flight(self) -> int:
        """Requests being read, handled or answered now (idle connections excluded)."""
        return self._in_flight

    @property
    def open_connections(self) -> int:
        """Connections currently served."""
        return len(self._connections)

    @property
    def watched_sockets(self) -> int:
        """Client sockets in the listeners' watch now: one per handler running
        (below the pipelining cap), none when idle."""
        return sum(watch.watched for watch in self._watches)

    @property
    def inflight_body_bytes(self) -> int:
        """Request-body bytes reserved by the bodies being received now (0 when none is)."""
        return self.listener.body_bytes

    @property
    def closing(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self.listener.closing

    async def wait_idle(self) -> None:
        """Return once no request is in flight (see :attr:`in_flight`)."""
        while self._in_flight:
            await self._idle.wait()

    def request_started(self) -> None:
        """A connection's next request began (its first bytes are in)."""
        if self._in_flight == 0:
            self._idle = trio.Event()
        self._in_flight += 1

    def request_done(self) -> None:
        """A request was answered, refused or given up on."""
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    def shutdown(self, *, close_idle: bool = True) -> None:
        """Stop accepting, close idle connections, close the rest after their response.

        ``close_idle=False`` (a hand-over to a successor): an idle keep-alive
        connection is not closed now but after its next response (or at its
        idle timeout).  Closing it while the client may be sending on it is
        the one way a server can fail a request it never saw; answering the
        next request with ``Connection: close`` is not.
        """
        self.listener.closing = True
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        if close_idle:
            for conn in list(self._connections):
                conn.close_if_idle()

    async def wait_closed(self) -> None:
        """Return once no connection is open (each closed after its last response)."""
        while self._connections:
            self._all_closed = trio.Event()
            await self._all_closed.wait()

    async def serve(
        self,
        host: str,
        port: int,
        *,
        listeners: list[trio.SocketListener] | None = None,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0 picks a port) until shut down or cancelled.

        ``listeners``: sockets already listening (inherited at a restart) instead.
        """
        if listeners is None:
            listeners = await trio.open_tcp_listeners(port, host=host)
        bound_port = int(listeners[0].socket.getsockname()[1])
        watch = ClientWatch()  # the clients of this listener whose handler runs
        self._watches.add(watch)
        try:
            async with trio.open_nursery() as watching:
                watching.start_soon(watch.run)
                async with trio.open_nursery() as connections:
                    with trio.CancelScope() as accept_scope:
                        self._accept_scope = accept_scope
                        if self.closing:
                            accept_scope.cancel()
                        async with trio.open_nursery() as acceptors:
                            for listener in listeners:
                                acceptors.start_soon(
                                    self._accept_loop, listener, connections, watch
                                )
                            task_status.started((host, bound_port))
                    for listener in listeners:
                        await trio.aclose_forcefully(listener)
                watching.cancel_scope.cancel()  # the last connection is done
        finally:
            self._watches.discard(watch)
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    async def _accept_loop(
        self, listener: trio.SocketListener, connections: trio.Nursery, watch: ClientWatch
    ) -> None:
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
            connections.start_soon(self._handle_connection, stream, watch)

    async def _handle_connection(self, stream: trio.SocketStream, watch: ClientWatch) -> None:
        conn: ServedConnection | None = None
        try:
            try:
                peer = stream.socket.getpeername()
            except OSError:
                return
            client = (str(peer[0]), int(peer[1]))
            if self.allow_peer is not None and not self.allow_peer(client[0]):
                log.warning("event=connection_refused client=%s reason=peer_filter", client[0])
                return
            conn = ServedConnection(self, stream, client, watch)
            self._connections.add(conn)
            await conn.run()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer reset or closed the connection: nothing to answer
        except* Exception as group:
            log.error("event=connection_error", exc_info=group)
        finally:
            if conn is not None:
                self._connections.discard(conn)
                if not self._connections:
                    self._all_closed.set()
            self._connection_slots.release()
            await trio.aclose_forcefully(stream)


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


__all__ = [
    "AbortResponse",
    "ClientDisconnected",
    "ErrorRenderer",
    "Handler",
    "HeadCheck",
    "HeadContext",
    "HttpLimits",
    "HttpServer",
    "RejectHook",
    "Request",
    "Responder",
    "serve_http",
]
