"""Semantic rules over the edge config: references, bounds, uniqueness, addresses.

Pure functions from a Struct to a list of ``ConfigProblem`` (YAML path,
reason), so they serve ``load.py`` (every problem of a file at once, written
as ``YAML.PATH: reason`` lines there), config refresh (the new file must
validate before it is classified) and tests alike.  The edge config is
checked one section (or family of rules) per function, in file order, so the
problems read top to bottom like the file.
Messages never contain secrets: token values are never echoed, and hashes
are named by the path of their first use rather than printed.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from dataclasses import dataclass

from iopd.config.addresses import is_loopback_host, origin_problem, parse_host_port
from iopd.config.fallback_graph import fallback_cycles
from iopd.config.placeholders import placeholder_hash_reason
from iopd.config.problems import ConfigProblem, join_key
from iopd.config.rules.collect import Errors, first_at
from iopd.config.rules.providers import check_provider
from iopd.config.rules.routing import check_routing
from iopd.config.schema import (
    EdgeConfig,
    EdgeSection,
    EdgeTLS,
    LimitsSection,
    ModelGroup,
    ModelRoute,
    NodeEntry,
    OpenAISection,
    PrincipalToken,
    ProviderConfig,
    ProviderPoolSection,
)
from iopd.vocabulary import forbidden_reason
from wire import scram
from wire.messages import MAX_PROVIDER_ID_CHARS, MAX_STATUS_ENTRIES

__all__ = [
    "Errors",
    "first_at",
    "is_loopback_host",
    "origin_problem",
    "parse_host_port",
    "validate_edge_config",
]

_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
#: Longest base ejection; doubled ejections stop at 10x this (see the outlier tracker).
MAX_EJECT_SECONDS = 86400.0
#: Most unauthenticated wire connections an edge may be told to hold.
MAX_PENDING_CAP = 65536


def _check_edge_tls(err: Errors, tls: EdgeTLS) -> None:
    err.tls_pair("edge.tls", tls.cert, tls.key)
    if tls.client_ca and not (tls.cert and tls.key):
        err.add("edge.tls.client_ca", "requires edge.tls.cert and edge.tls.key")


@dataclass(frozen=True)
class _Defined:
    """What ``nodes[]`` defines, for the sections that refer to it by id."""

    node_index: dict[str, str]  # node id -> path of its definition
    providers: dict[str, ProviderConfig]  # provider id -> its (first) definition
    provider_node: dict[str, str]  # provider id -> the id of the node it is on

    def provider_on(
        self, err: Errors, path: str, node_id: str | None, pid: str
    ) -> ProviderConfig | None:
        """Provider ``pid`` (on node ``node_id`` when given), or None after reporting why not."""
        if pid not in self.providers:
            err.add(path, f"provider {pid!r} is not defined under nodes[].providers")
            return None
        if (
            node_id is not None
            and node_id in self.node_index
            and self.provider_node[pid] != node_id
        ):
            err.add(path, f"provider {pid!r} is not defined on node {node_id!r}")
            return None
        return self.providers[pid]


def validate_edge_config(cfg: EdgeConfig) -> list[ConfigProblem]:
    """Every semantic problem of an edge config, in file order."""
    err = Errors()
    _check_edge_section(err, cfg.edge)
    defined = _check_nodes(err, cfg.nodes)
    _check_model_groups(err, cfg.models, defined)
    _check_fallbacks(err, cfg)
    _check_openai_listener(err, cfg)
    _check_principal_tokens(err, cfg.openai.principal_tokens)
    _check_cors(err, cfg.openai.cors_allow_origins)
    _check_model_routes(err, cfg.openai.model_routes, defined)
    _check_single_target_route(err, cfg.openai, defined)
    _check_provider_pool(err, cfg.provider_pool)
    _check_retries_and_ejection(err, cfg.provider_pool)
    err.problems.extend(check_routing(cfg.provider_pool.routing))
    _check_limits(err, cfg.limits, cfg.openai.principal_tokens)
    return err.problems


def _check_edge_section(err: Errors, e: EdgeSection) -> None:
    """``edge``: id, listen addresses (admin on loopback only), timeouts, frame cap, TLS."""
    err.wire_id("edge.id", e.id)
    err.address("edge.node_listen", e.node_listen)
    cap, per = e.node_listen_max_pending, e.node_listen_max_pending_per_address
    if not 1 <= cap <= MAX_PENDING_CAP:
        err.add("edge.node_listen_max_pending", f"must be 1 to {MAX_PENDING_CAP} (got {cap})")
    if not 1 <= per <= max(cap, 1):
        err.add("edge.node_listen_max_pending_per_address", f"must be 1 to {cap} (got {per})")
    admin_host = err.address("edge.admin_listen", e.admin_listen)
    if admin_host is not None and not is_loopback_host(admin_host):
        err.add(
            "edge.admin_listen",
            f"must be a loopback address (127.0.0.0/8, ::1 or localhost), got {e.admin_listen!r}",
        )
    if e.admin_token_hash_sha256 is not None:
        err.hash64("edge.admin_token_hash_sha256", e.admin_token_hash_sha256)
    err.positive("edge.drain_timeout", e.drain_timeout)
    err.positive("edge.heartbeat_interval", e.heartbeat_interval)
    err.positive("edge.heartbeat_timeout", e.heartbeat_timeout)
    if (
        e.heartbeat_interval > 0
        and e.heartbeat_timeout > 0
        and (not e.heartbeat_timeout > e.heartbeat_interval)
    ):
        err.add(
            "edge.heartbeat_timeout",
            f"must be greater than edge.heartbeat_interval ({e.heartbeat_interval})",
        )
    err.positive("edge.handshake_timeout", e.handshake_timeout)
    err.positive("edge.max_frame_bytes", e.max_frame_bytes)
    err.non_negative("edge.config_revision", e.config_revision)
    _check_edge_tls(err, e.tls)


def _check_nodes(err: Errors, nodes: list[NodeEntry]) -> _Defined:
    """``nodes[]``: unique node and provider ids, token hashes, each provider's own rules."""
    node_index: dict[str, str] = {}  # node id -> path of its definition
    provider_at: dict[str, str] = {}  # provider id -> path of its definition
    providers: dict[str, ProviderConfig] = {}
    provider_node: dict[str, str] = {}
    for n, node in enumerate(nodes):
        npath = f"nodes[{n}]"
        if err.wire_id(f"{npath}.id", node.id):
            first = first_at(node_index, node.id, npath)
            if first is not None:
                err.add(f"{npath}.id", f"duplicate node id {node.id!r} (first defined at {first})")
        _check_node_token(err, npath, node)
        if len(node.providers) > MAX_STATUS_ENTRIES:
            # The node's health report names all of them in one message.
            err.add(
                f"{npath}.providers",
                f"a node has at most {MAX_STATUS_ENTRIES} providers, got {len(node.providers)}",
            )
        for j, p in enumerate(node.providers):
            ppath = f"{npath}.providers[{j}]"
            if len(p.id) > MAX_PROVIDER_ID_CHARS:
                err.add(f"{ppath}.id", f"at most {MAX_PROVIDER_ID_CHARS} characters")
            elif err.not_empty(f"{ppath}.id", p.id):
                first = first_at(provider_at, p.id, ppath)
                if first is not None:
                    err.add(
                        f"{ppath}.id", f"duplicate provider id {p.id!r} (first defined at {first})"
                    )
                else:
                    providers[p.id] = p
                    provider_node[p.id] = node.id
            check_provider(err, ppath, p)
    return _Defined(node_index, providers, provider_node)


def _check_node_token(err: Errors, npath: str, node: NodeEntry) -> None:
    """A dialling node needs ``token_verifier`` or ``token_hash_sha256`` (not both);
    an embedded one neither, and its providers."""
    secrets_set = [k for k in ("token_verifier", "token_hash_sha256") if getattr(node, k)]
    if node.embedded:
        for key in secrets_set:
            err.add(f"{npath}.{key}", "must not be set for an embedded node (its token is minted)")
        if not node.providers:
            err.add(
                f"{npath}.providers",
                "an embedded node must define at least one provider (it serves nothing else)",
            )
    elif len(secrets_set) == 2:
        err.add(f"{npath}.token_hash_sha256", "set token_verifier or token_hash_sha256, not both")
    elif reason := placeholder_hash_reason(node.token_verifier):
        err.add(f"{npath}.token_verifier", reason)
    elif node.token_verifier:
        try:
            scram.Verifier.parse(node.token_verifier)
        except ValueError as exc:
            err.add(f"{npath}.token_verifier", str(exc))
    elif not node.token_hash_sha256:
        err.add(
            f"{npath}.token_hash_sha256",
            "required for a node that dials in: this or, stronger, token_verifier (see "
            "'iopd token'); or set embedded: true to run the node inside the edge",
        )
    else:
        err.hash64(f"{npath}.token_hash_sha256", node.token_hash_sha256)


def _check_model_groups(err: Errors, models: list[ModelGroup], defined: _Defined) -> None:
    """``models[]``: unique group ids, each provider defined and serving the model, limits."""
    providers = defined.providers
    group_index: dict[str, str] = {}
    for m, group in enumerate(models):
        mpath = f"models[{m}]"
        if err.not_empty(f"{mpath}.id", group.id):
            first = first_at(group_index, group.id, mpath)
            if first is not None:
                err.add(
                    f"{mpath}.id",
                    f"duplicate model group id {group.id!r} (first defined at {first})",
                )
        if not group.providers:
            err.add(f"{mpath}.providers", "must map at least one provider id to a served model")
        for pid, served in group.providers.items():
            ppath = join_key(f"{mpath}.providers", pid)
            if pid not in providers:
                err.add(ppath, f"provider {pid!r} is not defined under nodes[].providers")
            elif served not in providers[pid].models:
                err.add(
                    ppath,
                    f"served model {served!r} is not in the models of provider {pid!r}",
                )
        for key, limit in group.generation.limits.items():
            if not limit >= 0:
                err.add(join_key(f"{mpath}.generation.limits", key), f"must be >= 0 (got {limit})")


def _group_ids(cfg: EdgeConfig) -> set[str]:
    """Every model group id the catalog will know: models[], legacy routes, single target."""
    ids = {m.id for m in cfg.models} | {r.model for r in cfg.openai.model_routes}
    if cfg.openai.adapter is not None and cfg.openai.target is not None:
        ids.add(cfg.openai.target)
    return ids


def _check_fallbacks(err: Errors, cfg: EdgeConfig) -> None:
    """``models[].fallbacks``: known group ids, not the group itself, no repeats, no cycle."""
    known = _group_ids(cfg)
    # group id -> (index, fallbacks) of its first definition, as the catalog keeps it
    graph: dict[str, tuple[int, list[str]]] = {}
    for m, group in enumerate(cfg.models):
        graph.setdefault(group.id, (m, group.fallbacks))
        seen: dict[str, str] = {}
        for j, target in enumerate(group.fallbacks):
            fpath = f"models[{m}].fallbacks[{j}]"
            if target not in known:
                err.add(fpath, f"model group {target!r} is not defined")
            elif target == group.id:
                err.add(fpath, f"model group {target!r} cannot fall back to itself")
            else:
                first = first_at(seen, target, fpath)
                if first is not None:
                    err.add(fpath, f"model group {target!r} is listed twice (first at {first})")
    for path, cycle in fallback_cycles(graph):
        err.add(path, "fallback cycle: " + " -> ".join(repr(g) for g in cycle))


def _check_openai_listener(err: Errors, cfg: EdgeConfig) -> None:
    """``openai``: listen address, sizes (a body must fit in a frame), timeouts, auth headers."""
    o = cfg.openai
    e = cfg.edge
    err.address("openai.listen", o.listen)
    if o.bearer_token:
        err.real_token("openai.bearer_token", o.bearer_token)
    err.positive("openai.long_context_threshold_tokens", o.long_context_threshold_tokens)
    err.positive("openai.max_header_bytes", o.max_header_bytes)
    if not o.max_body_bytes > 0:
        err.add("openai.max_body_bytes", f"must be > 0 (got {o.max_body_bytes})")
    elif e.max_frame_bytes > 0 and not o.max_body_bytes < e.max_frame_bytes:
        err.add(
            "openai.max_body_bytes",
            f"must be less than edge.max_frame_bytes ({e.max_frame_bytes})",
        )
    err.positive("openai.request_timeout", o.request_timeout)
    err.positive("openai.idle_timeout", o.idle_timeout)
    err.positive("openai.header_timeout", o.header_timeout)
    err.positive("openai.body_timeout", o.body_timeout)
    err.positive("openai.max_connections", o.max_connections)
    err.positive("openai.send_timeout", o.send_timeout)
    if not o.max_inflight_body_bytes >= o.max_body_bytes:
        # Below it, a body of the largest allowed size could never be received.
        err.add(
            "openai.max_inflight_body_bytes",
            f"must be >= openai.max_body_bytes ({o.max_body_bytes})",
        )
    for name in ("header", "target_header"):
        value = getattr(o.provider_auth, name)
        if not _HEADER_NAME.match(value):
            err.add(f"openai.provider_auth.{name}", "must be a valid HTTP header name")

    if o.session_header is not None:
        reason = forbidden_reason(o.session_header)
        if not _HEADER_NAME.match(o.session_header):
            err.add("openai.session_header", "must be a valid HTTP header name")
        elif reason is not None or o.session_header.lower() in (
            o.provider_auth.header.lower(),
            "x-api-key",
            "api-key",
        ):
            err.add(
                "openai.session_header",
                f"{o.session_header!r} carries a credential or routing, never a session: "
                + (reason or "it is a credential header"),
            )

    for i, name in enumerate(o.forward_headers):
        hpath = f"openai.forward_headers[{i}]"
        reason = forbidden_reason(name)
        if not _HEADER_NAME.match(name):
            err.add(hpath, f"must be a valid HTTP header name (got {name[:80]!r})")
        elif reason is not None:
            err.add(hpath, f"{name!r} is never forwarded to a provider: {reason}")
        elif name.lower() == o.provider_auth.header.lower():
            err.add(
                hpath,
                f"{name!r} is openai.provider_auth.header: its value is never forwarded as is",
            )


def _check_cors(err: Errors, origins: list[str]) -> None:
    for i, origin in enumerate(origins):
        problem = origin_problem(origin)
        if problem is not None:
            err.add(f"openai.cors_allow_origins[{i}]", problem)


def _check_principal_tokens(err: Errors, tokens: list[PrincipalToken]) -> None:
    """``openai.principal_tokens[]``: unique refs and hashes, well-formed hashes, principals."""
    ref_at: dict[str, str] = {}
    hash_at: dict[str, str] = {}
    for i, tok in enumerate(tokens):
        tpath = f"openai.principal_tokens[{i}]"
        if err.not_empty(f"{tpath}.token_ref", tok.token_ref):
            first = first_at(ref_at, tok.token_ref, tpath)
            if first is not None:
                err.add(
                    f"{tpath}.token_ref",
                    f"duplicate token_ref {tok.token_ref!r} (first at {first})",
                )
        if err.hash64(f"{tpath}.token_hash_sha256", tok.token_hash_sha256):
            first = first_at(hash_at, tok.token_hash_sha256, tpath)
            if first is not None:
                err.add(f"{tpath}.token_hash_sha256", f"duplicate token hash (same as {first})")
        err.not_empty(f"{tpath}.principal_ref", tok.principal_ref)


def _check_model_routes(err: Errors, routes: list[ModelRoute], defined: _Defined) -> None:
    """``openai.model_routes[]`` (legacy): unique models; node, provider and target defined."""
    route_at: dict[str, str] = {}
    for r, route in enumerate(routes):
        rpath = f"openai.model_routes[{r}]"
        if err.not_empty(f"{rpath}.model", route.model):
            first = first_at(route_at, route.model, rpath)
            if first is not None:
                err.add(
                    f"{rpath}.model", f"duplicate route model {route.model!r} (first at {first})"
                )
        if route.node not in defined.node_index:
            err.add(f"{rpath}.node", f"node {route.node!r} is not defined under nodes[]")
        prov = defined.provider_on(err, f"{rpath}.adapter", route.node, route.adapter)
        if prov is not None and route.target not in prov.models:
            err.add(
                f"{rpath}.target",
                f"{route.target!r} is not in the models of provider {route.adapter!r}",
            )
        if route.queue_timeout is not None:
            err.positive(f"{rpath}.queue_timeout", route.queue_timeout)


def _check_single_target_route(err: Errors, o: OpenAISection, defined: _Defined) -> None:
    """``openai.adapter``/``target``/``node`` (the single-target fallback): all or none, defined."""
    if o.adapter is not None and o.target is None:
        err.add("openai.target", "required when openai.adapter is set")
    if o.target is not None and o.adapter is None:
        err.add("openai.adapter", "required when openai.target is set")
    if o.node is not None:
        if o.adapter is None and o.target is None:
            err.add("openai.node", "only meaningful with openai.adapter and openai.target")
        elif o.node not in defined.node_index:
            err.add("openai.node", f"node {o.node!r} is not defined under nodes[]")
    if o.adapter is not None and o.target is not None:
        prov = defined.provider_on(err, "openai.adapter", o.node, o.adapter)
        if prov is not None and o.target not in prov.models:
            err.add("openai.target", f"{o.target!r} is not in the models of provider {o.adapter!r}")


def _check_provider_pool(err: Errors, pool: ProviderPoolSection) -> None:
    """``provider_pool``: queue bounds."""
    err.non_negative("provider_pool.max_queue", pool.max_queue)
    err.non_negative("provider_pool.max_queued_bytes", pool.max_queued_bytes)
    err.positive("provider_pool.queue_timeout", pool.queue_timeout)


def _check_retries_and_ejection(err: Errors, pool: ProviderPoolSection) -> None:
    """``provider_pool`` retry and outlier-ejection knobs: counts >= 0, bounded durations."""
    err.non_negative("provider_pool.retry_attempts", pool.retry_attempts)
    if not (pool.retry_budget >= 0 and math.isfinite(pool.retry_budget)):
        err.add(
            "provider_pool.retry_budget", f"must be a finite number >= 0 (got {pool.retry_budget})"
        )
    err.non_negative("provider_pool.retry_budget_min", pool.retry_budget_min)
    err.non_negative("provider_pool.eject_after_failures", pool.eject_after_failures)
    if not 0 < pool.eject_seconds <= MAX_EJECT_SECONDS:
        err.add(
            "provider_pool.eject_seconds",
            f"must be > 0 and at most {MAX_EJECT_SECONDS:g} (a day) (got {pool.eject_seconds})",
        )


def _check_limits(err: Errors, limits: LimitsSection, tokens: list[PrincipalToken]) -> None:
    """``limits``: counts >= 0 (0 = unlimited), ``share`` >= 1, each entry a known principal once.

    A principal is known when some ``openai.principal_tokens[]`` entry maps to
    it; callers without a principal are limited by ``limits.default``.
    """
    known = {t.principal_ref for t in tokens}
    ref_at: dict[str, str] = {}
    entries = [("limits.default", limits.default, None)] + [
        (f"limits.principals[{i}]", p, p.principal_ref) for i, p in enumerate(limits.principals)
    ]
    for path, entry, ref in entries:
        if ref is not None and err.not_empty(f"{path}.principal_ref", ref):
            first = first_at(ref_at, ref, path)
            if first is not None:
                err.add(
                    f"{path}.principal_ref",
                    f"duplicate principal_ref {ref[:80]!r} (first at {first})",
                )
            elif ref not in known:
                err.add(
                    f"{path}.principal_ref",
                    f"unknown principal {ref[:80]!r}: no openai.principal_tokens[] entry has "
                    "this principal_ref (callers without a principal get limits.default)",
                )
        for name in (
            "max_concurrent",
            "requests_per_minute",
            "tokens_per_minute",
            "tokens_per_day",
        ):
            value = getattr(entry, name)
            if value is not None:
                err.non_negative(f"{path}.{name}", value)
        if entry.share is not None and entry.share < 1:
            err.add(f"{path}.share", f"must be >= 1 (got {entry.share})")
    _check_limits_backend(err, limits)


def _check_limits_backend(err: Errors, limits: LimitsSection) -> None:
    """``limits.backend`` and its store.  The URL is never echoed: it holds a password."""
    for name in ("backend_timeout", "lease_ttl"):
        value = getattr(limits, name)
        if not (math.isfinite(value) and 0 < value <= MAX_EJECT_SECONDS):
            err.add(
                f"limits.{name}", f"must be > 0 and at most {MAX_EJECT_SECONDS:g} (got {value})"
            )
    if limits.backend_timeout >= limits.lease_ttl / 3:
        err.add(
            "limits.backend_timeout",
            f"must be below limits.lease_ttl / 3 ({limits.lease_ttl / 3:g}): a lease renewal "
            "must end before the next one is due",
        )
    url = limits.redis_url
    if limits.backend == "redis" and not url:
        err.add("limits.redis_url", "required when limits.backend is redis")
    if url:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            err.add(
                "limits.redis_url",
                "must be redis://[user:password@]host[:port][/db] or rediss://... "
                "(the value is not shown: it may hold a password)",
            )
