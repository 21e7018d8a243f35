"""Addresses in the config: ``host:port`` listeners, loopback hosts, CORS origins.

Pure string checks, each giving the reason a value is wrong (``ValueError``
or ``None``); :mod:`iopd.config.rules` turns them into YAML-path problems.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

__all__ = [
    "Origin",
    "is_loopback_host",
    "origin_problem",
    "parse_host_port",
    "parse_provider_origin",
    "provider_origin_problem",
    "url_origin",
]

#: A provider's origin as the node's HTTP client dials it: scheme, host, port.
Origin = tuple[str, str, int]


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


def url_origin(url: str) -> Origin:
    """``(scheme, host, port)`` an http(s) URL reaches; raises ``ValueError`` with the reason.

    Parsed the way the node's provider client parses ``base_url``
    (``urlsplit``: lower-case scheme and host, the scheme's default port), so
    a check on this origin is a check on where the client connects.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a URL with a valid port ({exc})") from None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    return parts.scheme, parts.hostname, port if port is not None else _DEFAULT_PORTS[parts.scheme]


def parse_provider_origin(origin: str) -> Origin:
    """``node.allowed_provider_origins`` entry ``scheme://host[:port]``; raises ``ValueError``."""
    try:
        parts = urlsplit(origin)
    except ValueError:
        parts = None
    if (
        parts is None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
        or "@" in parts.netloc
    ):
        raise ValueError(
            f"must be an origin scheme://host[:port] without path, query or user "
            f"(got {origin[:80]!r})"
        )
    return url_origin(origin)


def provider_origin_problem(origin: str) -> str | None:
    """Why ``origin`` is no ``node.allowed_provider_origins`` entry (None: it is one)."""
    try:
        parse_provider_origin(origin)
    except ValueError as exc:
        return str(exc)
    return None
