"""``serve_wire``: the edge's wire listener (plain TCP or TLS).

Each accepted connection gets its own task running ``handler(stream)``; the
wrapper here logs whatever the handler let escape (one bad peer never takes
the daemon down) and closes the stream in ``finally``.  ``trio.Cancelled``
always propagates.

Why a ``PendingGate``: until a peer has authenticated it is anybody, and each
connection costs a file descriptor, a task and a handshake deadline.  The
gate caps the unauthenticated connections in total and per remote address;
a connection over a cap is refused in the accept loop itself (no task, no
TLS, no read: closed with a reset, counted, and logged at most once per
``REFUSAL_LOG_INTERVAL``).  The handler frees its slot the moment its peer
has authenticated (``PendingGate.release``), so established sessions never
count against the caps.  Every accept is a scheduler checkpoint (trio's
``accept`` yields after each connection), so a flood of connections cannot
keep the loop from serving the sessions' heartbeats or the public listener.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import math
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Literal

import trio

log = logging.getLogger("iopd.transport")

StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]
RefusalReason = Literal["max_pending", "max_pending_per_address"]

#: Seconds between two log lines about refused connections (each line says
#: how many were refused since the previous one).
REFUSAL_LOG_INTERVAL = 10.0
#: How long the accept loop pauses when the process is out of descriptors.
ACCEPT_CAPACITY_SLEEP = 0.1
#: ``accept`` errors that mean "out of resources, try again soon".
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Prefix length an IPv6 peer is counted by: one host usually holds a whole
#: /64, so counting single addresses would not bound it.
IPV6_KEY_PREFIX = 64
_LINGER_RESET = struct.pack("ii", 1, 0)


def address_key(host: str) -> str:
    """The per-address key of a peer: its IPv4 address, or its IPv6 /64."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, IPV6_KEY_PREFIX), strict=False))
    return str(addr)


class PendingGate:
    """Counts a listener's unauthenticated connections and refuses past its caps.

    ``enter(stream, key)`` admits a connection (it holds a slot until
    ``release(stream)``) or names the cap it is over.  ``release`` is
    idempotent and ignores streams it never admitted.  Synchronous, O(1).
    """

    def __init__(
        self,
        max_pending: int,
        max_per_address: int,
        *,
        on_refused: Callable[[RefusalReason], None] | None = None,
    ) -> None:
        if max_pending < 1 or max_per_address < 1:
            raise ValueError("pending caps must be >= 1")
        self.max_pending = max_pending
        self.max_per_address = max_per_address
        self.refused_total = 0
        self._on_refused = on_refused
        self._held: dict[trio.abc.Stream, str] = {}
        self._by_key: dict[str, int] = {}
        self._unlogged = 0
        self._next_log = -math.inf

    @property
    def pending(self) -> int:
        """Connections admitted that have not authenticated (or ended) yet."""
        return len(self._held)

    def pending_for(self, key: str) -> int:
        """Unauthenticated connections now held by the address ``key``."""
        return self._by_key.get(key, 0)

    def enter(self, stream: trio.abc.Stream, key: str) -> RefusalReason | None:
        """Admit ``stream`` from ``key`` (None), or say which cap refuses it."""
        if len(self._held) >= self.max_pending:
            return self._refuse("max_pending", key)
        held = self._by_key.get(key, 0)
        if held >= self.max_per_address:
            return self._refuse("max_pending_per_address", key)
        self._by_key[key] = held + 1
        self._held[stream] = key
        return None

    def release(self, stream: trio.abc.Stream) -> None:
        """``stream`` authenticated or ended: it no longer counts as pending.

        A TLS stream is known by the TCP stream under it (the gate admits a
        connection before any TLS object exists for it).
        """
        key = self._held.pop(getattr(stream, "transport_stream", stream), None)
        if key is None:
            return
        left = self._by_key[key] - 1
        if left:
            self._by_key[key] = left
        else:
            del self._by_key[key]

    def _refuse(self, reason: RefusalReason, key: str) -> RefusalReason:
        self.refused_total += 1
        self._unlogged += 1
        now = trio.current_time()
        if now >= self._next_log:
            log.warning(
                "event=wire_connection_refused reason=%s address=%s refused=%d pending=%d "
                "max_pending=%d max_pending_per_address=%d",
                reason,
                key,
                self._unlogged,
                len(self._held),
                self.max_pending,
                self.max_per_address,
            )
            self._unlogged = 0
            self._next_log = now + REFUSAL_LOG_INTERVAL
        if self._on_refused is not None:
            try:
                self._on_refused(reason)
            except Exception:
                log.exception("event=callback_failed component=listener callback=on_refused")
        return reason


async def _guarded(
    handler: StreamHandler, stream: trio.abc.Stream, gate: PendingGate | None = None
) -> None:
    try:
        await handler(stream)
    except Exception as exc:  # one connection's failure must not end the listener
        # (trio.Cancelled is a BaseException and propagates.)
        log.error("event=wire_handler_failed error=%s", type(exc).__name__, exc_info=True)
    finally:
        if gate is not None:
            gate.release(stream)
        await trio.aclose_forcefully(stream)


def _reset(stream: trio.SocketStream) -> None:
    """Close a refused connection at once, with a reset (no FIN handshake, no
    TIME_WAIT kept for it here)."""
    sock = stream.socket
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    except OSError:
        pass
    sock.close()


def _peer_key(stream: trio.SocketStream) -> str | None:
    try:
        host = stream.socket.getpeername()[0]
    except OSError:  # the peer is gone already
        return None
    return address_key(str(host))


async def _accept_loop(
    listener: trio.SocketListener,
    handler: StreamHandler,
    nursery: trio.Nursery,
    ssl_context: ssl.SSLContext | None,
    gate: PendingGate | None,
) -> None:
    """Accept forever; refuse past the gate's caps before any work; one task per admitted."""
    next_capacity_log = -math.inf
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno not in _CAPACITY_ERRNOS:
                raise
            now = trio.current_time()
            if now >= next_capacity_log:
                log.error("event=wire_accept_failed error=%s", errno.errorcode.get(exc.errno or 0))
                next_capacity_log = now + REFUSAL_LOG_INTERVAL
            await trio.sleep(ACCEPT_CAPACITY_SLEEP)
            continue
        if gate is not None:
            key = _peer_key(stream)
            if key is None or gate.enter(stream, key) is not None:
                _reset(stream)
                continue
        served: trio.abc.Stream = stream
        if ssl_context is not None:
            served = trio.SSLStream(stream, ssl_context, server_side=True, https_compatible=False)
        nursery.start_soon(_guarded, handler, served, gate)


async def serve_wire(
    handler: StreamHandler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    gate: PendingGate | None = None,
    listeners: list[trio.SocketListener] | None = None,
    stop_accepting: trio.Event | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept wire connections on ``host:port`` forever, one task per connection.

    ``task_status.started((host, port))`` reports the bound address (so port 0
    works in tests).  With ``ssl_context`` every connection is TLS (the
    handshake happens on the connection's first read, inside the handler).
    With ``gate`` the unauthenticated connections are capped (see the module
    doc); the handler calls ``gate.release(stream)`` once its peer has
    authenticated, and the slot is freed in any case when the handler returns.
    ``listeners``: sockets already listening (inherited at a restart) instead.
    ``stop_accepting``: once set, no connection is accepted any more (they
    wait in the kernel's queue for the successor that shares the socket);
    those accepted go on.
    """
    if listeners is None:
        listeners = await trio.open_tcp_listeners(port, host=host)
    bound: tuple[str, int] = listeners[0].socket.getsockname()[:2]
    log.info(
        "event=wire_listening address=%s:%d tls=%s", bound[0], bound[1], ssl_context is not None
    )
    try:
        async with trio.open_nursery() as nursery:  # the connections
            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(
                        _accept_loop, listener, handler, nursery, ssl_context, gate
                    )
                task_status.started(bound)
                if stop_accepting is not None:
                    await stop_accepting.wait()
                    accepting.cancel_scope.cancel()
            for listener in listeners:  # the connections accepted so far go on
                await trio.aclose_forcefully(listener)
    finally:
        for listener in listeners:
            await trio.aclose_forcefully(listener)
