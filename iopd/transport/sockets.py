"""Listening sockets: bound here, or inherited from whoever started this process.

Why: a restart that refuses nothing needs the new process to accept on the
very sockets the old one listens on, with the same kernel accept queue, so a
connection that arrives during the switch waits in that queue instead of
being refused (a port that is closed for an instant answers RST).  Two ways
hand sockets to an edge, both read here, both by name (``openai``,
``admin``, ``wire``):

* systemd socket activation: ``LISTEN_FDS`` sockets from fd 3 on, named by
  ``LISTEN_FDNAMES`` (the units' ``FileDescriptorName=``), for this process
  only when ``LISTEN_PID`` is its pid;
* an edge handing over to its successor (``iopd.edge.handover``):
  ``IOPD_LISTEN_FDS=openai=5,6;admin=7;wire=8``, the fds kept open across
  ``exec``.

Both variables are removed from the environment once read: a child of this
process never mistakes them for its own.  A name nobody hands over is bound
as configured.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

import trio

__all__ = ["LISTEN_FDS_ENV", "Inherited", "handover_value", "open_listeners"]

log = logging.getLogger("iopd.transport.sockets")

#: An edge's own hand-over: ``name=fd,fd;name=fd``.
LISTEN_FDS_ENV = "IOPD_LISTEN_FDS"
#: systemd's first passed fd (``SD_LISTEN_FDS_START``).
_SD_FIRST_FD = 3
#: At most this many sockets are taken over (a bound on a malformed variable).
_MAX_FDS = 64


class Inherited:
    """The listening sockets this process was given, by name; each taken once."""

    def __init__(self, fds: dict[str, list[int]] | None = None) -> None:
        self._fds = dict(fds or {})

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Inherited:
        """Read (and remove) ``IOPD_LISTEN_FDS`` or systemd's ``LISTEN_*``; empty if neither."""
        env = os.environ if environ is None else environ
        own = env.pop(LISTEN_FDS_ENV, None)
        count = env.pop("LISTEN_FDS", None)
        pid = env.pop("LISTEN_PID", None)
        names = env.pop("LISTEN_FDNAMES", None)
        if own:
            return cls(_parse_own(own))
        if count and (pid is None or pid == str(os.getpid())):
            return cls(_parse_systemd(count, names or ""))
        return cls()

    def __bool__(self) -> bool:
        return bool(self._fds)

    def take(self, name: str) -> list[socket.socket]:
        """The sockets handed over as ``name`` (none: an empty list)."""
        out = []
        for fd in self._fds.pop(name, []):
            try:
                sock = socket.socket(fileno=fd)
            except OSError as exc:
                log.warning(
                    "event=inherited_socket_unusable name=%s fd=%d error=%r", name, fd, str(exc)
                )
                continue
            if sock.type != socket.SOCK_STREAM or not sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN
            ):
                log.warning(
                    "event=inherited_socket_unusable name=%s fd=%d error='not listening'", name, fd
                )
                sock.detach()
                continue
            sock.setblocking(False)
            out.append(sock)
        return out

    def close_rest(self) -> None:
        """Close what no listener took (a name this config no longer listens on)."""
        for name, fds in self._fds.items():
            log.info("event=inherited_socket_unused name=%s", name)
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fds.clear()


def _parse_own(raw: str) -> dict[str, list[int]]:
    fds: dict[str, list[int]] = {}
    total = 0
    for item in raw.split(";"):
        name, _, numbers = item.partition("=")
        for number in numbers.split(","):
            if number.strip().isdigit() and total < _MAX_FDS:
                fds.setdefault(name.strip(), []).append(int(number))
                total += 1
    return fds


def _parse_systemd(count: str, names: str) -> dict[str, list[int]]:
    if not count.isdigit():
        return {}
    n = min(int(count), _MAX_FDS)
    labels = names.split(":") if names else []
    fds: dict[str, list[int]] = {}
    for i in range(n):
        label = labels[i] if i < len(labels) and labels[i] else "unknown"
        fds.setdefault(label, []).append(_SD_FIRST_FD + i)
    return fds


async def open_listeners(
    name: str, host: str, port: int, inherited: Inherited | None
) -> list[trio.SocketListener]:
    """The listeners of ``name``: the inherited sockets if any were handed over, else bound."""
    taken = inherited.take(name) if inherited else []
    if taken:
        bound = taken[0].getsockname()
        log.info(
            "event=listener_inherited name=%s address=%s:%s count=%d",
            name,
            bound[0],
            bound[1],
            len(taken),
        )
        return [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in taken]
    return await trio.open_tcp_listeners(port, host=host)


def handover_value(named: dict[str, list[trio.SocketListener]]) -> tuple[str, list[int]]:
    """``IOPD_LISTEN_FDS``'s value for ``named`` and the fds a successor must keep open."""
    parts, fds = [], []
    for name, listeners in named.items():
        numbers = [listener.socket.fileno() for listener in listeners]
        numbers = [n for n in numbers if n >= 0]
        if numbers:
            parts.append(f"{name}={','.join(map(str, numbers))}")
            fds += numbers
    return ";".join(parts), fds
