"""A restart that refuses nothing: the edge hands its sockets to its successor.

On ``SIGUSR2`` (``iopd restart``, or ``systemctl reload``-free upgrades
under systemd) the running edge starts a new ``iopd edge`` with the same
arguments, its listening sockets kept open across ``exec``
(``IOPD_LISTEN_FDS``, read by ``iopd.transport.sockets``) and one end of a
pipe (``IOPD_HANDOVER_FD``).  The two processes then take turns, so that at
every instant some process accepts on every port and no request waits for a
node:

1. the successor loads its config and listens on the wire and admin
   sockets it was given, then writes ``wire``;
2. the old edge stops accepting node connections and tells each node
   ``GoAway`` (a node that understands it dials again, which now reaches
   the successor, while its old session goes on serving the streams in
   flight); the successor waits until its nodes are connected (at most
   ``NODE_WAIT``), starts the OpenAI listener and writes ``ready``;
3. the old edge stops accepting OpenAI and admin connections, answers the
   next request on each open connection with ``Connection: close`` and
   drains: once no connection is left (or at ``edge.drain_timeout``) it
   closes its node sessions and exits.

The sockets are the same kernel objects throughout: a connection that
arrives while both processes hold them waits in the one accept queue for
whichever accepts it.  If the successor fails before ``ready`` (a config
error, a crash) the old edge logs why and goes on serving: an upgrade that
does not start rolls itself back.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, MutableMapping

import trio

from iopd.transport.sockets import LISTEN_FDS_ENV, handover_value

__all__ = [
    "HANDOVER_FD_ENV",
    "NODE_WAIT",
    "HandoverFailed",
    "HandoverOutcome",
    "Successor",
    "hand_over",
    "successor_argv",
]

log = logging.getLogger("iopd.edge.handover")

#: The write end of the pipe the successor reports its progress on.
HANDOVER_FD_ENV = "IOPD_HANDOVER_FD"
#: How long a successor waits for its nodes before it serves OpenAI requests.
NODE_WAIT = 10.0
#: How long the old edge waits for its successor's ``ready``.
SUCCESSOR_TIMEOUT = 60.0
#: How long a successor that closed its pipe gets to exit before it is stopped.
_EXIT_WAIT = 2.0
#: A progress line is at most this long (a bound on what the pipe may hold).
_MAX_LINE = 64


class HandoverFailed(Exception):
    """The successor did not take over; the old edge goes on serving."""


class HandoverOutcome:
    """One hand-over's end, awaited by whoever asked for it (``POST /restart``)."""

    def __init__(self) -> None:
        self.done = trio.Event()
        #: The successor's pid once it took over.
        self.successor_pid: int | None = None
        #: Why there was no hand-over (refused, or the successor failed).
        self.error: str | None = None

    def finish(self, *, pid: int | None = None, error: str | None = None) -> None:
        self.successor_pid, self.error = pid, error
        self.done.set()


class Successor:
    """The new process's side: reports ``wire`` then ``ready`` to its predecessor."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Successor | None:
        """The pipe to the predecessor (removed from the environment), or None."""
        env = os.environ if environ is None else environ
        raw = env.pop(HANDOVER_FD_ENV, None)
        if raw is None or not raw.isdigit():
            return None
        return cls(int(raw))

    def tell(self, word: str) -> None:
        """Write one progress word; a predecessor gone already is not an error."""
        if self._fd < 0:
            return
        try:
            os.write(self._fd, word.encode() + b"\n")
        except OSError:
            self.close()

    def close(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1


async def hand_over(
    argv: list[str],
    listeners: dict[str, list[trio.SocketListener]],
    *,
    on_wire: Callable[[], None],
    timeout: float = SUCCESSOR_TIMEOUT,
) -> int:
    """Start the successor, run ``on_wire`` at its ``wire``; its pid once it is ``ready``.

    Raises :class:`HandoverFailed` (the successor is stopped if it still runs)
    when it exits, says something else or is not ready within ``timeout``.
    """
    value, fds = handover_value(listeners)
    read_fd, write_fd = os.pipe()
    env = dict(os.environ)
    env[LISTEN_FDS_ENV] = value
    env[HANDOVER_FD_ENV] = str(write_fd)
    try:
        proc = await trio.lowlevel.open_process(
            argv,
            env=env,
            pass_fds=(*fds, write_fd),
            start_new_session=True,  # not in the terminal's process group: a ^C is the old's
        )
    except OSError as exc:
        os.close(read_fd)
        raise HandoverFailed(f"cannot start {argv[0]}: {exc.strerror or exc}") from None
    finally:
        os.close(write_fd)
    log.info("event=handover_started successor_pid=%d", proc.pid)
    stream = trio.lowlevel.FdStream(read_fd)
    try:
        with trio.move_on_after(timeout):
            await _follow(stream, proc, on_wire)
            return proc.pid
    finally:
        await stream.aclose()
    _stop(proc)
    raise HandoverFailed(f"the new process was not ready within {timeout:g} s")


async def _follow(
    stream: trio.lowlevel.FdStream, proc: trio.Process, on_wire: Callable[[], None]
) -> None:
    buffer = b""
    while True:
        chunk = await stream.receive_some(_MAX_LINE)
        if not chunk:  # the successor closed the pipe: it has exited, or is about to
            with trio.move_on_after(_EXIT_WAIT):
                await proc.wait()
            status = proc.poll()
            if status is None:
                _stop(proc)
                raise HandoverFailed("the new process closed its hand-over pipe")
            raise HandoverFailed(f"the new process exited with status {status} before it was ready")
        buffer += chunk
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            word = line.decode("ascii", "replace")
            if word == "wire":
                on_wire()
            elif word == "ready":
                return
            else:
                _stop(proc)
                raise HandoverFailed(f"the new process said {word[:_MAX_LINE]!r}")
        if len(buffer) > _MAX_LINE:
            _stop(proc)
            raise HandoverFailed("the new process wrote more than a progress line")


def _stop(proc: trio.Process) -> None:
    if proc.poll() is None:
        proc.terminate()  # (reaped by trio's process machinery)


def successor_argv(config_path: str, log_level: str | None) -> list[str]:
    """The command line of the successor: this interpreter, ``iopd edge``, the same config."""
    argv = [sys.executable, "-m", "iopd", "edge", "--config", config_path]
    if log_level:
        argv += ["--log-level", log_level]
    return argv
