"""One task per server that watches the sockets of the handlers running now.

While a handler runs, its client's socket must stay watched: bytes the
client pipelines are buffered, and its EOF or reset cancels the handler at
once.  A watcher task per connection did that for two task steps, a cancel
scope and two poller updates per request.  Here the server keeps one task
and a private ``epoll`` set of its own: a handler's start registers the
socket (one ``epoll_ctl``), its end removes it (one more), and the task,
woken through trio when any watched socket is readable, calls that
connection's ``on_ready`` synchronously.  ``on_ready`` must read the socket
or stop watching it (the set is level-triggered: bytes left unread would
wake the task again at once).

Linux only (``select.epoll``), as the edge is.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable

import trio

__all__ = ["ClientWatch"]

log = logging.getLogger("iopd.http.server")

#: Ready sockets handled per scheduler round.
_BATCH = 64


class ClientWatch:
    """The watched sockets of one server, by file descriptor."""

    __slots__ = ("_epoll", "_ready")

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._ready: dict[int, Callable[[], None]] = {}

    @property
    def watched(self) -> int:
        """Sockets watched now (tests, diagnostics)."""
        return len(self._ready)

    def watch(self, fd: int, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` whenever ``fd`` is readable, until :meth:`unwatch`.

        Raises ``OSError`` when the socket cannot be watched (closed).
        """
        if fd in self._ready:  # a closed socket's number, reused: the kernel dropped it
            self.unwatch(fd)
        self._epoll.register(fd, select.EPOLLIN)
        self._ready[fd] = on_ready

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (idempotent; before the socket is closed)."""
        if self._ready.pop(fd, None) is None:
            return
        try:
            self._epoll.unregister(fd)
        except OSError:  # already closed: the kernel dropped it from the set
            pass

    async def run(self) -> None:
        """The watching task, for the server's life (cancel it to stop)."""
        try:
            epoll_fd = self._epoll.fileno()
            while True:
                await trio.lowlevel.wait_readable(epoll_fd)
                # At most a batch per scheduler round: a crowd of readable
                # sockets cannot hold the loop (each read is one RECEIVE_SIZE).
                for fd, _events in self._epoll.poll(0, _BATCH):
                    on_ready = self._ready.get(fd)
                    if on_ready is None:
                        continue
                    try:
                        on_ready()
                    except Exception:  # one connection's bug must not end the watching
                        log.exception("event=client_watch_failed")
                        self.unwatch(fd)
        finally:
            self._ready.clear()
            self._epoll.close()
