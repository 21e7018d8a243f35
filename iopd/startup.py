"""Start-up failures as one line: ``iopd <command>: <what> <where>: <reason>``.

A daemon that cannot start (a port in use, a certificate file missing, a
config file it cannot read) must say which port or file and why, in one
line an operator can act on, and exit 1.  Where the failure happens the
code raises ``StartupError`` with those three parts (``listen_failed`` for a
bind); ``run_daemon`` runs the daemon under trio and takes the first
``StartupError`` out of the exception group trio's nurseries wrap it in;
``iopd.cli.main`` prints it with the command name.  Nothing else is caught
here: ``trio.Cancelled``, ``KeyboardInterrupt`` and real bugs keep their
meaning and their traceback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

__all__ = ["StartupError", "listen_failed", "os_reason", "run_daemon"]


class StartupError(Exception):
    """A daemon could not start: ``what`` failed on ``where`` (an address or path) because ``reason``."""

    def __init__(self, what: str, where: str, reason: str) -> None:
        self.what = what
        self.where = where
        self.reason = _lower_first(reason)
        super().__init__(f"{what} {where}: {self.reason}")


def _lower_first(text: str) -> str:
    """``No such file`` -> ``no such file``; acronyms (``PEM lib``) stay as they are."""
    return text[0].lower() + text[1:] if text[:2].istitle() else text


def os_reason(exc: OSError) -> str:
    """The system's words for ``exc`` (``address already in use``), without ``[Errno 98]``."""
    return exc.strerror or str(exc) or type(exc).__name__


def listen_failed(address: str, exc: OSError) -> StartupError:
    """A listener could not bind ``address`` (as the config writes it, ``host:port``)."""
    return StartupError("cannot listen on", address, os_reason(exc))


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def run_daemon(main: Callable[[], Awaitable[object]]) -> None:
    """``trio.run(main)``; a ``StartupError`` inside trio's exception group is raised alone.

    Other exceptions in the same group are re-raised by ``except*`` as they
    were, so nothing but the start-up failure is turned into a line.
    """
    import trio  # here, not at the top: ``iopd token`` and friends never load trio

    failure: StartupError | None = None
    try:
        trio.run(main)
    except* StartupError as group:
        failure = next(e for e in _leaves(group) if isinstance(e, StartupError))
    if failure is not None:
        raise failure from None
