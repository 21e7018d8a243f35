"""The node's side of the transport: ``dial`` the edge, and the reconnect ``Backoff``.

Backoff is exponential with *full jitter* (a uniformly random delay between 0
and the current cap), the scheme that best spreads a fleet of nodes
reconnecting after an edge restart.  ``reset()`` after a session that got
through the handshake starts over at the initial delay.
"""

from __future__ import annotations

import random
import socket
import ssl
from collections.abc import Callable

import trio

from iopd.transport.channel import ChannelClosed


class DialError(ChannelClosed):
    """Could not reach the edge (refused, unreachable, timed out, TLS failed)."""


async def dial(
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    connect_timeout: float,
) -> trio.abc.Stream:
    """Open a TCP (and, with ``ssl_context``, TLS) stream to the edge.

    The TCP connect and the TLS handshake together get ``connect_timeout``
    seconds.  Raises ``DialError`` with a loggable reason.
    """
    tcp: trio.SocketStream | None = None
    try:
        with trio.fail_after(connect_timeout):
            tcp = await trio.open_tcp_stream(host, port)
            if ssl_context is None:
                return tcp
            tls = trio.SSLStream(
                tcp,
                ssl_context,
                server_hostname=server_hostname or host,
                https_compatible=False,
            )
            await tls.do_handshake()
            return tls
    except trio.TooSlowError:
        reason = f"connect to {host}:{port} timed out after {connect_timeout:g}s"
    except ssl.SSLError as exc:
        reason = f"TLS handshake with {host}:{port} failed: {exc.reason or type(exc).__name__}"
    except trio.BrokenResourceError as exc:
        cause = exc.__cause__
        detail = getattr(cause, "reason", None) or type(cause).__name__
        reason = f"TLS handshake with {host}:{port} failed: {detail}"
    except OSError as exc:
        reason = _connect_failed(host, port, exc)
    if tcp is not None:
        await trio.aclose_forcefully(tcp)
    raise DialError(reason, "broken")


def _leaf(exc: OSError) -> OSError:
    """The error of the one attempt that says why: trio wraps the attempts of
    ``open_tcp_stream`` (one per address) in a group behind a plain ``OSError``."""
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        leaves = [e for e in cause.exceptions if isinstance(e, OSError)]
        refused = [e for e in leaves if isinstance(e, ConnectionRefusedError)]
        if refused or leaves:
            return (refused or leaves)[0]
    return exc


def _connect_failed(host: str, port: int, exc: OSError) -> str:
    """One line: the address, what happened and what it likely means."""
    leaf = _leaf(exc)
    if isinstance(leaf, ConnectionRefusedError):
        return (
            f"connection refused by {host}:{port}: the edge may not be running yet, "
            "or this is not its edge.node_listen"
        )
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {host!r}: {exc.strerror or type(exc).__name__} (check the edge's address)"
    why = leaf.strerror or type(leaf).__name__
    return f"connect to {host}:{port} failed: {why[:1].lower()}{why[1:]}"


class Backoff:
    """Reconnect delays: exponential growth, capped, with full jitter.

    ``next()`` returns a delay uniform in ``[0, min(cap, initial * 2**n)]`` for
    the n-th failure since the last ``reset()``.  ``max_delay()`` is a delay at
    the cap (jittered in its upper half), for failures retrying faster cannot fix.
    """

    def __init__(
        self,
        initial: float,
        cap: float,
        *,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if initial <= 0 or cap <= 0:
            raise ValueError("backoff delays must be > 0")
        self.initial = initial
        self.cap = max(cap, initial)
        self._rng = rng
        self.attempt = 0

    def ceiling(self) -> float:
        """The current upper bound of ``next()``."""
        return min(self.cap, self.initial * 2.0 ** min(self.attempt, 64))

    def next(self) -> float:
        """The delay before the next attempt; grows the ceiling."""
        delay = self._rng() * self.ceiling()
        self.attempt += 1
        return delay

    def max_delay(self) -> float:
        """A delay near the cap: ``[cap/2, cap]``."""
        return self.cap * (0.5 + 0.5 * self._rng())

    def reset(self) -> None:
        """A session succeeded: start over at ``initial``."""
        self.attempt = 0

    def __iter__(self) -> Backoff:
        return self

    def __next__(self) -> float:
        return self.next()
