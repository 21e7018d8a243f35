"""TLS contexts for the wire, from the config sections (``edge.tls`` / ``node.tls``).

All fields null means plain TCP (``None``).  The edge with ``client_ca``
requires and verifies a client certificate (mutual TLS).  The node verifies
the edge against ``ca`` (or the system store when only a client cert is set).
"""

from __future__ import annotations

import ssl

from iopd.config.schema import EdgeTLS, NodeTLS
from iopd.startup import StartupError, os_reason


class TLSConfigError(StartupError, ValueError):
    """The TLS settings are inconsistent or a file cannot be loaded (``where`` names it)."""


def _readable(key: str, path: str) -> None:
    """Raise ``TLSConfigError`` naming ``key`` and ``path`` when the file cannot be read.

    ``ssl`` reports a missing file without saying which of cert, key or CA
    it was; checking each first lets the error name the one to fix.
    """
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TLSConfigError(f"cannot read {key}", path, os_reason(exc)) from None


def _unloadable(section: str, paths: str, exc: ssl.SSLError) -> TLSConfigError:
    return TLSConfigError(f"cannot load {section} certificates", paths, str(exc))


def server_ssl_context(tls: EdgeTLS) -> ssl.SSLContext | None:
    """The edge's server context, or ``None`` for plain TCP."""
    if tls.cert is None and tls.key is None and tls.client_ca is None:
        return None
    if tls.cert is None or tls.key is None:
        raise TLSConfigError("invalid TLS settings", "edge.tls", "cert and key must both be set")
    _readable("edge.tls.cert", tls.cert)
    _readable("edge.tls.key", tls.key)
    if tls.client_ca is not None:
        _readable("edge.tls.client_ca", tls.client_ca)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
        if tls.client_ca is not None:
            ctx.load_verify_locations(cafile=tls.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as exc:
        files = ", ".join(p for p in (tls.cert, tls.key, tls.client_ca) if p)
        raise _unloadable("edge.tls", files, exc) from None
    return ctx


def client_ssl_context(tls: NodeTLS) -> ssl.SSLContext | None:
    """The node's client context, or ``None`` for plain TCP."""
    if tls.ca is None and tls.cert is None and tls.key is None:
        return None
    if (tls.cert is None) != (tls.key is None):
        raise TLSConfigError("invalid TLS settings", "node.tls", "cert and key must be set together")
    for key, path in (("node.tls.ca", tls.ca), ("node.tls.cert", tls.cert), ("node.tls.key", tls.key)):
        if path is not None:
            _readable(key, path)
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if tls.cert is not None and tls.key is not None:
            ctx.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as exc:
        files = ", ".join(p for p in (tls.ca, tls.cert, tls.key) if p)
        raise _unloadable("node.tls", files, exc) from None
    return ctx
