"""Serving the admin app: hypercorn's trio worker, inside the edge's own nursery.

One process, one trio run: ``AdminServer.serve`` is started by ``run_edge``
like every other listener and reports the address it bound.  It is
``hypercorn.trio.run.worker_serve`` reassembled from the same pieces (its
``Lifespan``, ``WorkerContext`` and per-connection ``TCPServer``) for three
things ``hypercorn.trio.serve`` has no hook for:

- the peer filter runs on the accepted socket, before any HTTP is spoken
  (a refused peer gets a closed connection, as on every iopd listener);
- the listener is bound by trio here (port 0, the edge's own bind errors),
  and its address is reported as ``(host, port)``;
- a connection handler that fails logs one line and never takes the edge down.

Shutdown (``shutdown()``, called at the end of the edge's drain): stop
accepting, close idle keep-alive connections at once (hypercorn's
``context.terminated``), give requests in progress ``graceful_timeout``
seconds, then run the app's lifespan shutdown.

hypercorn is made quiet and bounded here: no access log unless the log level
is debug, its errors as one line through iopd's logging (no tracebacks), a
16 KiB limit on a request head, an idle keep-alive timeout, a deadline on
every socket write (``send_timeout``; ``stream_send_timeout`` on an event
stream).  Deliberately not
set: hypercorn's ``read_timeout`` — it also runs while a response streams,
and would end a console event stream whose browser has nothing to send.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.logging import Logger as HypercornLogger
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    LifespanState,
    ResponseSummary,
    Scope,
    WWWScope,
)
from hypercorn.utils import LifespanFailureError, LifespanTimeoutError, wrap_app
from quart_trio import QuartTrio

from iopd.startup import StartupError

log = logging.getLogger("iopd.edge.admin")
#: One line per request at debug level: the access log an operator asks for.
access_log = logging.getLogger("iopd.edge.admin.access")


@dataclass(frozen=True)
class AdminLimits:
    """Bounds of the admin listener (the body limit is the app's, ``MAX_BODY_BYTES``)."""

    #: Largest request line + headers (h11's ``max_incomplete_event_size``).
    max_header_bytes: int = 16 * 1024
    #: An idle keep-alive connection (or one that never finishes its head) is closed after this.
    keep_alive_timeout: float = 5.0
    #: At shutdown, how long requests in progress (an event stream) get before they are cut.
    graceful_timeout: float = 1.0
    #: How long the app's startup and shutdown hooks may take.
    lifespan_timeout: float = 10.0
    #: Connections served at once; more are closed at accept (loopback operators only).
    max_connections: int = 64
    #: A socket write that takes longer (a client that stopped reading) ends its connection.
    send_timeout: float = 30.0
    #: The same for an event stream (``text/event-stream``, the console's ``/events``):
    #: shorter, so a tab that stopped reading gives its stream slot back within seconds.
    stream_send_timeout: float = 5.0


#: The write deadline of the ASGI send in progress, when shorter than the
#: connection's: set by ``_ShieldedSends`` around an event stream's sends and
#: read by ``_BoundedTCPServer.protocol_send``, which that send awaits in the
#: same task (hypercorn's stream → protocol → server chain has no task hop).
_send_deadline: ContextVar[float | None] = ContextVar("admin_send_deadline", default=None)


def _is_event_stream(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether an ASGI response head says ``Content-Type: text/event-stream``."""
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"text/event-stream"
    return False


class _ShieldedSends:
    """The app's ASGI ``send`` runs shielded from the app's own cancellation.

    quart-trio cancels a request's handler when hypercorn reports
    ``http.disconnect``, and hypercorn reports it *from inside* the app's
    last ``send``: after the final body chunk it ends the stream (queueing
    ``http.disconnect`` to the app) and then, for ``Connection: close``,
    closes the socket — or, on keep-alive, restarts the idle timer.  The
    cancellation lands between the two, so the socket stayed open until the
    client closed it and a keep-alive connection lost its idle timeout
    (``scripts/bench_http.py --frameworks``: "not closed within 3 s").
    Shielded, the send finishes its bookkeeping; it cannot hang, since the
    socket write inside is bounded by ``AdminLimits.send_timeout``.

    An event stream's sends get ``stream_send_timeout`` instead: such a
    response holds one of the console's few stream slots for as long as it
    lives, so a client that stopped reading must let go of it long before a
    plain response's write deadline.
    """

    def __init__(self, app: QuartTrio, stream_send_timeout: float = math.inf) -> None:
        self.app = app
        self.stream_send_timeout = stream_send_timeout

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        streaming = False

        async def send_shielded(message: ASGISendEvent) -> None:
            nonlocal streaming
            if message["type"] == "http.response.start":
                streaming = _is_event_stream(message.get("headers", ()))
            token = _send_deadline.set(self.stream_send_timeout) if streaming else None
            try:
                with trio.CancelScope(shield=True):
                    await send(message)
            finally:
                if token is not None:
                    _send_deadline.reset(token)

        await self.app(scope, receive, send_shielded)


class _BoundedTCPServer(TCPServer):
    """hypercorn's connection with a deadline on each socket write.

    hypercorn shields every write from cancellation, so a client that stops
    reading would hold its connection — and the edge's shutdown — forever.
    The deadline is ``send_timeout``, or the shorter one of the send in
    progress (``_send_deadline``: an event stream's).
    """

    send_timeout: float = 30.0

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        seconds = min(self.send_timeout, _send_deadline.get() or math.inf)
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True):
                    with trio.fail_after(seconds):
                        await self.stream.send_all(event.data)
            except trio.TooSlowError:
                log.warning("event=admin_send_timeout seconds=%g", seconds)
                await trio.aclose_forcefully(self.stream)
                await self.protocol.handle(Closed())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())


class _QuietLog(HypercornLogger):
    """hypercorn's logger, speaking through iopd's: one line per error, no traceback."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.error_logger = log
        self.access_logger = None

    async def access(
        self, request: WWWScope, response: ResponseSummary | None, request_time: float
    ) -> None:
        if access_log.isEnabledFor(logging.DEBUG):
            access_log.debug(
                "event=admin_request method=%s path=%r status=%s duration_ms=%.1f",
                request.get("method", "-"),
                request.get("path", "")[:200],
                response["status"] if response is not None else "-",
                request_time * 1000,
            )

    async def exception(self, message: str, *args: object, **kwargs: object) -> None:
        exc = sys.exc_info()[1]
        log.error("event=admin_http_error what=%r error=%s", message % args, type(exc).__name__)


def hypercorn_config(limits: AdminLimits) -> Config:
    """hypercorn's ``Config`` for the admin listener, from ``limits``."""
    config = Config()
    config.logger_class = _QuietLog
    config.accesslog = None
    config.errorlog = None
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.h2_max_concurrent_streams = 8  # only by h2c upgrade; nobody needs it, keep it small
    config.keep_alive_timeout = limits.keep_alive_timeout
    config.graceful_timeout = limits.graceful_timeout
    config.startup_timeout = limits.lifespan_timeout
    config.shutdown_timeout = limits.lifespan_timeout
    config.include_server_header = False
    return config


class AdminServer:
    """The admin app on hypercorn's trio worker; ``serve`` like any iopd listener."""

    def __init__(
        self,
        app: QuartTrio,
        *,
        limits: AdminLimits = AdminLimits(),
        allow_peer: Callable[[str], bool] | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.config = hypercorn_config(limits)
        self.allow_peer = allow_peer
        self._asgi: AppWrapper = wrap_app(
            _ShieldedSends(app, limits.stream_send_timeout), self.config.wsgi_max_body_size, "asgi"
        )
        self._context = WorkerContext(None)
        self._lifespan_state: LifespanState = {}
        self._slots = trio.Semaphore(limits.max_connections)
        self._shutdown = trio.Event()
        #: Set when ``serve`` has returned (or failed): the lifespan shutdown ran.
        self.stopped = trio.Event()

    def shutdown(self) -> None:
        """Stop accepting, close idle connections, end the rest after ``graceful_timeout``."""
        self._shutdown.set()

    async def serve(
        self,
        host: str,
        port: int,
        *,
        listeners: list[trio.SocketListener] | None = None,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (0 picks a port) until ``shutdown()`` or cancelled.

        ``listeners``: sockets already listening (inherited at a restart) instead.
        """
        try:
            if listeners is None:
                listeners = await trio.open_tcp_listeners(port, host=host)
            bound = (host, int(listeners[0].socket.getsockname()[1]))
            lifespan = _Lifespan(self._asgi, self.config, self._lifespan_state)
            try:
                async with trio.open_nursery() as lifespan_nursery:
                    await lifespan_nursery.start(lifespan.handle_lifespan)
                    await lifespan.wait_for_startup()
                    if lifespan.startup_failure is not None:  # never serve after a failed startup
                        raise _StartupFailed(lifespan.startup_failure)
                    await self._serve_connections(listeners, bound, task_status)
                    await lifespan.wait_for_shutdown()
                    lifespan_nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                failure, rest = group.split(
                    (_StartupFailed, LifespanFailureError, LifespanTimeoutError)
                )
                if failure is None or rest is not None:
                    raise
                raise _lifespan_error(lifespan, bound) from None
        finally:
            self.stopped.set()

    async def _serve_connections(
        self,
        listeners: list[trio.SocketListener],
        bound: tuple[str, int],
        task_status: trio.TaskStatus[tuple[str, int]],
    ) -> None:
        try:
            async with trio.open_nursery() as connections:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept_loop, listener, connections)
                    task_status.started(bound)
                    await self._shutdown.wait()
                    accepting.cancel_scope.cancel()
                await self._context.terminated.set()  # idle keep-alive connections close now
                connections.cancel_scope.deadline = (
                    trio.current_time() + self.config.graceful_timeout
                )
        finally:
            for listener in listeners:
                await trio.aclose_forcefully(listener)

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            stream = await listener.accept()
            connections.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        """One connection: the peer filter and the connection cap, then hypercorn's HTTP."""
        try:
            try:
                peer = str(stream.socket.getpeername()[0])
            except OSError:  # already reset by the peer
                return
            if self.allow_peer is not None and not self.allow_peer(peer):
                log.warning("event=connection_refused client=%s reason=peer_filter", peer)
                return
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                log.warning("event=connection_refused client=%s reason=max_connections", peer)
                return
            try:
                server = _BoundedTCPServer(
                    self._asgi,
                    self.config,
                    self._context,
                    self._lifespan_state,
                    # hypercorn annotates an SSLStream; it serves a plain SocketStream alike.
                    stream,  # type: ignore[arg-type]
                )
                server.send_timeout = self.limits.send_timeout
                await server.run()
            finally:
                self._slots.release()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away: nothing to answer
        except* Exception as group:  # a bug in the HTTP layer must not end the edge
            log.error(
                "event=admin_connection_error error=%s",
                ",".join(type(e).__name__ for e in group.exceptions),
            )
        finally:
            await trio.aclose_forcefully(stream)


class _StartupFailed(Exception):
    """The app's startup hook failed (its message is on the ``_Lifespan``)."""


class _Lifespan(Lifespan):
    """hypercorn's lifespan driver, which also remembers why the startup failed.

    hypercorn sets its startup event on failure too, so whether the startup
    worked is read here rather than raced against the failing task.
    """

    startup_failure: str | None = None

    async def asgi_send(self, message: ASGISendEvent) -> None:
        if message["type"] == "lifespan.startup.failed":
            self.startup_failure = message.get("message", "") or "failed"
        await super().asgi_send(message)


def _lifespan_error(lifespan: _Lifespan, bound: tuple[str, int]) -> StartupError:
    """The app's startup hook failed (or hung): one line naming the admin listener."""
    if lifespan.startup_failure is not None:
        reason = f"startup: {lifespan.startup_failure}"
    else:
        reason = "its startup or shutdown hooks failed or did not finish in time"
    return StartupError("admin app failed on", f"{bound[0]}:{bound[1]}", reason)
