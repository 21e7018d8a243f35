"""systemd readiness notification (``sd_notify``) with the stdlib only.

Why this module exists: the units in ``scripts/systemd/`` use ``Type=notify``,
so systemd considers a daemon started only once it sends ``READY=1`` — after
every listener is bound, not merely after the process forked.  The protocol is
one datagram of newline-separated ``KEY=VALUE`` assignments to the AF_UNIX
socket named by ``$NOTIFY_SOCKET`` (a filesystem path, or an abstract socket
when it starts with ``@``).  Pulling in a dependency for ten lines is not worth
it, and notification is best effort: outside systemd (``NOTIFY_SOCKET`` unset)
every call is a no-op, and a failure to notify must never take a daemon down,
so nothing here raises.

Where the daemons call it (see docs/operations.md):

* edge (``iopd/edge/daemon.py``): ``notify(*ready(f"edge {id} serving"))`` once
  every listener is bound **and** the signal receiver is installed (else a
  ``systemctl reload`` right after start kills the process); around the
  SIGHUP refresh ``notify(*reloading())`` and, in a ``finally``,
  ``notify(*ready(...))`` again (a unit left "reloading" never leaves it);
  ``notify(*stopping())`` when the drain starts.
* node (``iopd/node/run.py``): ``ready()`` once started, ``stopping()`` when
  its drain starts.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = [
    "NOTIFY_SOCKET_ENV",
    "notify",
    "ready",
    "reloading",
    "status",
    "stopping",
]

#: The environment variable systemd sets for ``Type=notify`` services.
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"


def _socket_address(raw: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` → an ``AF_UNIX`` address, or None when it is not usable."""
    if raw.startswith("@"):
        # Abstract namespace (Linux): a leading NUL byte instead of the '@'.
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    # systemd also documents vsock:CID:PORT; iopd's units never use it.
    return None


def _clean(state: str) -> str:
    """One assignment per line: a newline inside a value would forge another key."""
    return state.replace("\r", " ").replace("\n", " ")


def notify(*states: str, env: dict[str, str] | None = None) -> bool:
    """Send ``states`` (``"READY=1"``, ``"STATUS=..."``) to systemd in one datagram.

    Returns True when the datagram was sent, False when ``$NOTIFY_SOCKET`` is
    unset, unusable or the send failed.  Never raises.  ``env`` replaces
    ``os.environ`` (for tests).
    """
    if not states:
        return False
    raw = (env if env is not None else os.environ).get(NOTIFY_SOCKET_ENV, "")
    if not raw:
        return False
    address = _socket_address(raw)
    if address is None:
        return False
    payload = "\n".join(_clean(s) for s in states).encode("utf-8", "replace")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.sendto(payload, address)
    except (OSError, ValueError):
        return False
    return True


def status(text: str) -> str:
    """A ``STATUS=`` assignment (shown by ``systemctl status``)."""
    return f"STATUS={text}"


def ready(status_text: str | None = None) -> tuple[str, ...]:
    """States for "the daemon serves": ``READY=1`` (+ ``STATUS=``)."""
    return ("READY=1",) + ((status(status_text),) if status_text else ())


def reloading(status_text: str = "reloading config") -> tuple[str, ...]:
    """States for "a config reload started".

    ``MONOTONIC_USEC`` (CLOCK_MONOTONIC in µs) is what ``Type=notify-reload``
    (systemd ≥ 253) requires with ``RELOADING=1``; plain ``Type=notify`` units
    accept it too.  Follow with ``ready()`` once the reload finished.
    """
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return ("RELOADING=1", f"MONOTONIC_USEC={usec}", status(status_text))


def stopping(status_text: str = "draining") -> tuple[str, ...]:
    """States for "the daemon is shutting down" (the drain started)."""
    return ("STOPPING=1", status(status_text))
