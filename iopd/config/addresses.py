"""Addresses in the config: ``host:port`` listeners, loopback hosts, CORS origins.

Pure string checks, each giving the reason a value is wrong (``ValueError``
or ``None``); :mod:`iopd.config.validate` turns them into YAML-path problems.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["is_loopback_host", "origin_problem", "parse_host_port"]


def parse_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:7071``); raises ``ValueError`` with the reason."""
    if not address or address != address.strip() or any(c.isspace() for c in address):
        raise ValueError("must be host:port without spaces, e.g. 127.0.0.1:7070")
    if address.startswith("["):
        end = address.find("]")
        if end < 0 or address[end + 1 : end + 2] != ":":
            raise ValueError("must be [IPv6]:port, e.g. [::1]:7071")
        host, port_text = address[1:end], address[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"'{host}' in brackets is not an IPv6 address") from None
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise ValueError("must be host:port, e.g. 127.0.0.1:7070 (the port is missing)")
        if ":" in host:
            raise ValueError("an IPv6 address must be in brackets, e.g. [::1]:7071")
        if not host:
            raise ValueError("the host is empty (use 0.0.0.0 or [::] to listen on every interface)")
    if not port_text.isascii() or not port_text.isdigit():
        raise ValueError("the port must be a number 0..65535")
    port = int(port_text)
    if port > 65535:
        raise ValueError("the port must be a number 0..65535")
    return host, port


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: A browser's serialized origin: lower-case scheme and host, an optional port.
_ORIGIN = re.compile(r"^(https?)://([a-z0-9.-]+|\[[0-9a-f:.]+\])(?::([0-9]{1,5}))?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_problem(origin: str) -> str | None:
    """Why ``origin`` can never match a browser's ``Origin`` header (None: it can)."""
    if origin == "*":
        return None
    m = _ORIGIN.match(origin)
    if m is None:
        return (
            f"must be '*' or an origin http(s)://host[:port] in lower case, without "
            f"path or trailing '/' (got {origin[:80]!r})"
        )
    port = m.group(3)
    if port is not None:
        if not 1 <= int(port) <= 65535:
            return f"port {port} is out of range"
        if int(port) == _DEFAULT_PORTS[m.group(1)]:
            return f"drop the default port :{port}: browsers send the origin without it"
    return None
