"""TLS contexts for the wire, from the config sections (``edge.tls`` / ``node.tls``).

All fields null means plain TCP (``None``).  The edge with ``client_ca``
requires and verifies a client certificate (mutual TLS).  The node verifies
the edge against ``ca`` (or the system store when only a client cert is set).
"""

from __future__ import annotations

import ssl

from iopd.config.schema import EdgeTLS, NodeTLS


class TLSConfigError(ValueError):
    """The TLS settings are inconsistent or the files cannot be loaded."""


def server_ssl_context(tls: EdgeTLS) -> ssl.SSLContext | None:
    """The edge's server context, or ``None`` for plain TCP."""
    if tls.cert is None and tls.key is None and tls.client_ca is None:
        return None
    if tls.cert is None or tls.key is None:
        raise TLSConfigError("edge.tls: cert and key must both be set")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(tls.cert, tls.key)
        if tls.client_ca is not None:
            ctx.load_verify_locations(cafile=tls.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"edge.tls: cannot load certificates: {exc}") from None
    return ctx


def client_ssl_context(tls: NodeTLS) -> ssl.SSLContext | None:
    """The node's client context, or ``None`` for plain TCP."""
    if tls.ca is None and tls.cert is None and tls.key is None:
        return None
    if (tls.cert is None) != (tls.key is None):
        raise TLSConfigError("node.tls: cert and key must be set together")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if tls.cert is not None and tls.key is not None:
            ctx.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"node.tls: cannot load certificates: {exc}") from None
    return ctx
