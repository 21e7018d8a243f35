"""The provider client's errors, and the one boundary that maps low-level failures to them.

Apart from ``client.py`` so that the client's module stays about connections
and exchanges; ``iopd.http.client`` re-exports the public classes.
"""

from __future__ import annotations

import ssl

import trio

from iopd.http.h1 import H1ProtocolError

__all__ = [
    "ProviderConnectError",
    "ProviderHTTPError",
    "ProviderProtocolError",
    "ProviderResetError",
    "ProviderTimeoutError",
]


class ProviderHTTPError(Exception):
    """Base of every error the provider client raises."""


class ProviderConnectError(ProviderHTTPError):
    """The provider could not be reached (refused, DNS, TLS, connect timeout)."""


class ProviderTimeoutError(ProviderHTTPError):
    """The provider stopped answering for longer than ``read_timeout``."""


class ProviderProtocolError(ProviderHTTPError):
    """The provider broke HTTP/1.1 or dropped the connection mid-response."""


class ProviderResetError(ProviderProtocolError):
    """A fresh connection broke while the request was being written.

    The provider never read a whole request, so it cannot have acted on it
    (the edge may retry it on another provider); a break after the request
    was sent is a plain ``ProviderProtocolError``.
    """


class _StaleConnection(Exception):
    """A reused connection failed before any response byte: safe to retry once."""


class _ErrorMapper:
    """The one boundary where low-level errors become ``ProviderHTTPError``s.

    A context manager; ``trio.Cancelled`` is a BaseException and passes
    through untouched.  A class rather than ``@contextmanager``: it wraps
    every read of a relayed body, and a generator-based one costs several
    times more to enter and leave.
    """

    __slots__ = ("phase",)

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or isinstance(exc, ProviderHTTPError):
            return
        phase = self.phase
        if isinstance(exc, trio.TooSlowError):
            if phase == "connect":
                raise ProviderConnectError("connect timed out") from None
            raise ProviderTimeoutError(f"provider did not answer in time ({phase})") from None
        if isinstance(exc, H1ProtocolError):
            raise ProviderProtocolError(f"invalid HTTP from provider: {exc}") from None
        if isinstance(exc, ssl.SSLError):
            raise ProviderConnectError(f"TLS error: {exc.reason or exc}") from None
        if isinstance(exc, OSError | trio.BrokenResourceError | trio.ClosedResourceError):
            if phase == "connect":
                raise ProviderConnectError(f"cannot connect: {_describe(exc)}") from None
            raise ProviderProtocolError(f"connection lost ({phase}): {_describe(exc)}") from None


_ERROR_MAPPERS = {phase: _ErrorMapper(phase) for phase in ("connect", "request", "read body")}


def _map_errors(phase: str) -> _ErrorMapper:
    """The error boundary for ``phase`` (``connect``, ``request`` or ``read body``)."""
    return _ERROR_MAPPERS[phase]


def _describe(exc: BaseException) -> str:
    """A short reason: the OS error text, else the exception's own message."""
    for candidate in (exc, exc.__cause__):
        if isinstance(candidate, OSError) and candidate.strerror:
            return candidate.strerror
    text = " ".join(str(exc).split())[:200] or type(exc).__name__
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):  # trio's "all attempts to connect ... failed"
        reasons = {e.strerror for e in cause.exceptions if isinstance(e, OSError) and e.strerror}
        if reasons:
            text += ": " + ", ".join(sorted(reasons))
    return text
