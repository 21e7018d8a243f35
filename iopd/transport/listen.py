"""``serve_wire``: the edge's wire listener (plain TCP or TLS).

Each accepted connection gets its own task running ``handler(stream)``; the
wrapper here logs whatever the handler let escape (one bad peer never takes
the daemon down) and closes the stream in ``finally``.  ``trio.Cancelled``
always propagates.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger("iopd.transport")

StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]


async def _guarded(handler: StreamHandler, stream: trio.abc.Stream) -> None:
    try:
        await handler(stream)
    except Exception as exc:  # one connection's failure must not end the listener
        # (trio.Cancelled is a BaseException and propagates.)
        log.error("event=wire_handler_failed error=%s", type(exc).__name__, exc_info=True)
    finally:
        await trio.aclose_forcefully(stream)


async def serve_wire(
    handler: StreamHandler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept wire connections on ``host:port`` forever, one task per connection.

    ``task_status.started((host, port))`` reports the bound address (so port 0
    works in tests).  With ``ssl_context`` every connection is TLS (the
    handshake happens on the connection's first read, inside the handler).
    """
    tcp_listeners = await trio.open_tcp_listeners(port, host=host)
    bound: tuple[str, int] = tcp_listeners[0].socket.getsockname()[:2]
    listeners: list[trio.abc.Listener[Any]] = list(tcp_listeners)
    if ssl_context is not None:
        listeners = [
            trio.SSLListener(lst, ssl_context, https_compatible=False) for lst in tcp_listeners
        ]
    log.info("event=wire_listening address=%s:%d tls=%s", bound[0], bound[1], ssl_context is not None)

    async def on_connection(stream: trio.abc.Stream) -> None:
        await _guarded(handler, stream)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, on_connection, listeners)
        task_status.started(bound)
