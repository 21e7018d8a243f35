"""Semantic rules over a node config: its edges, token, TLS, backoff and consent.

The node's twin of ``rules/edge.py`` (the same ``Errors`` collector, so the
problems read like the file, top to bottom); the shapes of the consent keys
are ``node_consent.py``'s.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from iopd.config.node_consent import consent_problems
from iopd.config.problems import ConfigProblem
from iopd.config.rules.collect import Errors, first_at
from iopd.config.schema import NodeConfigFile, NodeSection, NodeTLS

__all__ = ["validate_node_config"]


def _check_node_tls(err: Errors, tls: NodeTLS) -> None:
    err.tls_pair("node.tls", tls.cert, tls.key)


def _edge_address(err: Errors, path: str, address: str) -> str | None:
    """One edge address: ``host:port``; a URL gets a line of its own (its scheme
    would otherwise read as an IPv6 address without brackets)."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme.isalpha():
        try:
            host = urlsplit(address).hostname or "edge.example.com"
        except ValueError:  # an unclosed bracket
            host = "edge.example.com"
        host = f"[{host}]" if ":" in host else host
        err.add(
            path,
            f"must be host:port, not a URL (got {address[:80]!r}): write the address of the "
            f"edge's edge.node_listen (the wire port, not the OpenAI port), e.g. {host[:80]}:7070",
        )
        return None
    return err.address(path, address)


def _check_node_edges(err: Errors, n: NodeSection) -> None:
    """``node.edge`` (one edge) or ``node.edges`` (several, each once): exactly one."""
    if n.edge and n.edges:
        err.add("node.edges", "set node.edge (one edge) or node.edges (several), not both")
    elif n.edges:
        seen: dict[str, str] = {}
        for i, address in enumerate(n.edges):
            path = f"node.edges[{i}]"
            host = _edge_address(err, path, address)
            if host is not None and (first := first_at(seen, address.lower(), path)):
                err.add(path, f"duplicate edge address (same as {first})")
    elif n.edge:
        _edge_address(err, "node.edge", n.edge)
    else:
        err.add("node.edge", "required: the edge's host:port (or node.edges: a list, for several)")


def validate_node_config(cfg: NodeConfigFile) -> list[ConfigProblem]:
    """Every semantic problem of a node config, in file order."""
    err = Errors()
    n = cfg.node
    err.wire_id("node.id", n.id)
    _check_node_edges(err, n)
    if err.not_empty("node.token", n.token):
        err.real_token("node.token", n.token)
    _check_node_tls(err, n.tls)
    err.positive("node.drain_timeout", n.drain_timeout)
    err.positive("node.reconnect_initial_backoff", n.reconnect_initial_backoff)
    err.positive("node.reconnect_max_backoff", n.reconnect_max_backoff)
    if (
        n.reconnect_initial_backoff > 0
        and n.reconnect_max_backoff > 0
        and n.reconnect_initial_backoff > n.reconnect_max_backoff
    ):
        err.add(
            "node.reconnect_initial_backoff",
            f"must not exceed node.reconnect_max_backoff ({n.reconnect_max_backoff})",
        )
    err.positive("node.max_frame_bytes", n.max_frame_bytes)
    err.problems.extend(consent_problems(n))
    return err.problems
