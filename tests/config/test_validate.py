"""Every semantic validation rule, each with its exact message.

The rules: docs/configuration.md, "Validation rules".
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from iopd.config.addresses import is_loopback_host, parse_host_port
from iopd.config.problems import ConfigProblem
from iopd.config.rules.edge import validate_edge_config
from tests.support.configs import edge_yaml
from tests.support.gateway import edge_config
from tests.support.validate_cases import P1, Mutation, errors_of
from wire import scram

NODE_BASE: dict[str, Any] = {"node": {"id": "node-a", "edge": "127.0.0.1:7070", "token": "t"}}


def test_base_configs_are_valid() -> None:
    assert errors_of(lambda d: None) == []
    assert errors_of(lambda d: None, NODE_BASE) == []


def test_the_rules_run_on_a_typed_config_in_file_order() -> None:
    """``validate_edge_config`` itself, on a Struct the schema accepted: every
    problem at once, top to bottom like the file (the cases below go through
    the loader, which calls it)."""
    cfg = edge_config(edge_yaml())
    assert validate_edge_config(cfg) == []
    broken = msgspec.structs.replace(
        cfg,
        openai=msgspec.structs.replace(cfg.openai, request_timeout=0),
        provider_pool=msgspec.structs.replace(cfg.provider_pool, max_queue=-1),
    )
    problems = validate_edge_config(broken)
    assert [p.path for p in problems] == ["openai.request_timeout", "provider_pool.max_queue"]
    assert all(isinstance(p, ConfigProblem) for p in problems)


def prov(d: dict[str, Any], n: int, j: int) -> dict[str, Any]:
    p: dict[str, Any] = d["nodes"][n]["providers"][j]
    return p


def set_in(path: list[Any], value: Any) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        target: Any = d
        for key in path[:-1]:
            if isinstance(target, dict):
                target = target.setdefault(key, {})
            else:
                target = target[key]
        target[path[-1]] = value

    return mutate


def both(*mutations: Mutation) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        for m in mutations:
            m(d)

    return mutate


def add_route(**route: Any) -> Mutation:
    def mutate(d: dict[str, Any]) -> None:
        d["openai"].setdefault("model_routes", []).append(route)

    return mutate


ROUTE_OK = {"model": "legacy", "node": "node-a", "adapter": "vllm-a", "target": "m-a"}

CASES: list[tuple[str, Mutation, str]] = [
    # --- uniqueness
    (
        "duplicate provider id",
        lambda d: prov(d, 1, 0).update(id="vllm-a"),
        "nodes[1].providers[0].id: duplicate provider id 'vllm-a' (first defined at nodes[0].providers[0])",
    ),
    (
        "duplicate node id",
        lambda d: d["nodes"][1].update(id="node-a"),
        "nodes[1].id: duplicate node id 'node-a' (first defined at nodes[0])",
    ),
    (
        "duplicate model group",
        lambda d: d["models"].append({"id": "g1", "providers": {"echo-b": "echo"}}),
        "models[1].id: duplicate model group id 'g1' (first defined at models[0])",
    ),
    # --- references
    (
        "undefined provider in models",
        lambda d: d["models"][0]["providers"].update({"vllm-x": "m-a"}),
        "models[0].providers.vllm-x: provider 'vllm-x' is not defined under nodes[].providers",
    ),
    (
        "served name not in provider models",
        lambda d: d["models"][0]["providers"].update({"vllm-a": "other"}),
        "models[0].providers.vllm-a: served model 'other' is not in the models of provider 'vllm-a'",
    ),
    (
        "empty model group",
        set_in(["models", 0, "providers"], {}),
        "models[0].providers: must map at least one provider id to a served model",
    ),
    # --- numeric bounds
    (
        "capacity >= 1",
        lambda d: prov(d, 0, 0).update(capacity=0),
        "nodes[0].providers[0].capacity: must be >= 1 (got 0)",
    ),
    (
        "long_context_capacity <= capacity",
        lambda d: prov(d, 0, 0).update(long_context_capacity=5),
        "nodes[0].providers[0].long_context_capacity: must be between 0 and capacity (4) (got 5)",
    ),
    (
        "long_context_capacity >= 0",
        lambda d: prov(d, 0, 0).update(long_context_capacity=-1),
        "nodes[0].providers[0].long_context_capacity: must be between 0 and capacity (4) (got -1)",
    ),
    (
        "priority >= 0",
        lambda d: prov(d, 0, 0).update(priority=-1),
        "nodes[0].providers[0].priority: must be >= 0 (got -1)",
    ),
    (
        "config_revision >= 0",
        set_in(["edge", "config_revision"], -1),
        "edge.config_revision: must be >= 0 (got -1)",
    ),
    (
        "max_queue >= 0",
        set_in(["provider_pool", "max_queue"], -1),
        "provider_pool.max_queue: must be >= 0 (got -1)",
    ),
    (
        "max_queued_bytes >= 0",
        set_in(["provider_pool", "max_queued_bytes"], -1),
        "provider_pool.max_queued_bytes: must be >= 0 (got -1)",
    ),
    (
        "queue_timeout > 0",
        set_in(["provider_pool", "queue_timeout"], 0),
        "provider_pool.queue_timeout: must be > 0 (got 0.0)",
    ),
    (
        "connect_timeout > 0",
        lambda d: prov(d, 0, 0).update(connect_timeout=0),
        "nodes[0].providers[0].connect_timeout: must be > 0 (got 0.0)",
    ),
    (
        "read_timeout > 0",
        lambda d: prov(d, 0, 0).update(read_timeout=-3),
        "nodes[0].providers[0].read_timeout: must be > 0 (got -3.0)",
    ),
    (
        "first_byte_timeout > 0",
        lambda d: prov(d, 0, 0).update(first_byte_timeout=0),
        "nodes[0].providers[0].first_byte_timeout: must be > 0 (got 0.0)",
    ),
    (
        "first_byte_timeout at most a day",
        lambda d: prov(d, 0, 0).update(first_byte_timeout=86401),
        "nodes[0].providers[0].first_byte_timeout: must be at most 86400 (got 86401.0)",
    ),
    (
        "health_interval > 0",
        lambda d: prov(d, 0, 0).update(health_interval=0),
        "nodes[0].providers[0].health_interval: must be > 0 (got 0.0)",
    ),
    (
        "nan timeout",
        lambda d: prov(d, 0, 0).update(read_timeout=float("nan")),
        "nodes[0].providers[0].read_timeout: must be > 0 (got nan)",
    ),
    (
        "kill_grace >= 0",
        lambda d: prov(d, 0, 1).update(kill_grace=-1),
        "nodes[0].providers[1].kill_grace: must be >= 0 (got -1.0)",
    ),
    (
        "delay_ms >= 0",
        lambda d: prov(d, 1, 0).update(delay_ms=-5),
        "nodes[1].providers[0].delay_ms: must be >= 0 (got -5)",
    ),
    (
        "anthropic_messages only on an openai provider",
        lambda d: prov(d, 1, 0).update(anthropic_messages=True),
        "nodes[1].providers[0].anthropic_messages: only a type 'openai' provider relays "
        "the Messages API (this one is 'echo')",
    ),
    (
        "openai_responses: false only on an openai provider",
        lambda d: prov(d, 1, 0).update(openai_responses=False),
        "nodes[1].providers[0].openai_responses: only a type 'openai' provider relays "
        "the Responses API (this one is 'echo')",
    ),
    (
        "drain_timeout > 0",
        set_in(["edge", "drain_timeout"], 0),
        "edge.drain_timeout: must be > 0 (got 0.0)",
    ),
    (
        "handshake_timeout > 0",
        set_in(["edge", "handshake_timeout"], 0),
        "edge.handshake_timeout: must be > 0 (got 0.0)",
    ),
    (
        "node_listen_max_pending >= 1",
        set_in(["edge", "node_listen_max_pending"], 0),
        "edge.node_listen_max_pending: must be 1 to 65536 (got 0)",
    ),
    (
        "node_listen_max_pending bounded",
        set_in(["edge", "node_listen_max_pending"], 65537),
        "edge.node_listen_max_pending: must be 1 to 65536 (got 65537)",
    ),
    (
        "node_listen_max_pending_per_address >= 1",
        set_in(["edge", "node_listen_max_pending_per_address"], 0),
        "edge.node_listen_max_pending_per_address: must be 1 to 256 (got 0)",
    ),
    (
        "node_listen_max_pending_per_address <= node_listen_max_pending",
        both(
            set_in(["edge", "node_listen_max_pending"], 8),
            set_in(["edge", "node_listen_max_pending_per_address"], 9),
        ),
        "edge.node_listen_max_pending_per_address: must be 1 to 8 (got 9)",
    ),
    (
        "edge id fits a handshake frame",
        set_in(["edge", "id"], "e" * 1025),
        "edge.id: must be at most 1024 characters (got 1025)",
    ),
    (
        "node id fits a handshake frame",
        lambda d: d["nodes"][0].update(id="n" * 1025),
        "nodes[0].id: must be at most 1024 characters (got 1025)",
    ),
    (
        "heartbeat_interval > 0",
        set_in(["edge", "heartbeat_interval"], 0),
        "edge.heartbeat_interval: must be > 0 (got 0.0)",
    ),
    (
        "heartbeat_timeout > heartbeat_interval",
        both(set_in(["edge", "heartbeat_interval"], 10), set_in(["edge", "heartbeat_timeout"], 10)),
        "edge.heartbeat_timeout: must be greater than edge.heartbeat_interval (10.0)",
    ),
    (
        "request_timeout > 0",
        set_in(["openai", "request_timeout"], 0),
        "openai.request_timeout: must be > 0 (got 0.0)",
    ),
    (
        "idle_timeout > 0",
        set_in(["openai", "idle_timeout"], -1),
        "openai.idle_timeout: must be > 0 (got -1.0)",
    ),
    (
        "header_timeout > 0",
        set_in(["openai", "header_timeout"], 0),
        "openai.header_timeout: must be > 0 (got 0.0)",
    ),
    (
        "send_timeout > 0",
        set_in(["openai", "send_timeout"], 0),
        "openai.send_timeout: must be > 0 (got 0.0)",
    ),
    (
        "max_connections > 0",
        set_in(["openai", "max_connections"], 0),
        "openai.max_connections: must be > 0 (got 0)",
    ),
    (
        "max_inflight_body_bytes >= max_body_bytes",
        set_in(["openai", "max_inflight_body_bytes"], 1024),
        "openai.max_inflight_body_bytes: must be >= openai.max_body_bytes (8388608)",
    ),
    (
        "threshold > 0",
        set_in(["openai", "long_context_threshold_tokens"], 0),
        "openai.long_context_threshold_tokens: must be > 0 (got 0)",
    ),
    (
        "max_body_bytes > 0",
        set_in(["openai", "max_body_bytes"], 0),
        "openai.max_body_bytes: must be > 0 (got 0)",
    ),
    (
        "max_body_bytes < max_frame_bytes",
        both(set_in(["openai", "max_body_bytes"], 1000), set_in(["edge", "max_frame_bytes"], 1000)),
        "openai.max_body_bytes: must be less than edge.max_frame_bytes (1000)",
    ),
    (
        "generation limit >= 0",
        set_in(["models", 0, "generation"], {"limits": {"max_tokens": -1}}),
        "models[0].generation.limits.max_tokens: must be >= 0 (got -1)",
    ),
    # --- lifecycle capabilities
    (
        "unknown lifecycle capability",
        lambda d: prov(d, 0, 0).update(lifecycle_capabilities=["streaming", "teleport"]),
        "nodes[0].providers[0].lifecycle_capabilities[1]: unknown capability 'teleport' "
        "(known: cancel, health_probe, long_context, passthrough, reasoning, responses, "
        "streaming, tool_calls)",
    ),
    # --- addresses
    (
        "admin not loopback",
        set_in(["edge", "admin_listen"], "0.0.0.0:7071"),
        "edge.admin_listen: must be a loopback address (127.0.0.0/8, ::1 or localhost), got '0.0.0.0:7071'",
    ),
    (
        "admin hostname not loopback",
        set_in(["edge", "admin_listen"], "example.com:7071"),
        "edge.admin_listen: must be a loopback address (127.0.0.0/8, ::1 or localhost), got 'example.com:7071'",
    ),
    (
        "address without port",
        set_in(["edge", "node_listen"], "127.0.0.1"),
        "edge.node_listen: must be host:port, e.g. 127.0.0.1:7070 (the port is missing) (got '127.0.0.1')",
    ),
    (
        "port out of range",
        set_in(["openai", "listen"], "127.0.0.1:70000"),
        "openai.listen: the port must be a number 0..65535 (got '127.0.0.1:70000')",
    ),
    (
        "port not a number",
        set_in(["openai", "listen"], "127.0.0.1:http"),
        "openai.listen: the port must be a number 0..65535 (got '127.0.0.1:http')",
    ),
    (
        "bare ipv6",
        set_in(["edge", "node_listen"], "::1:7070"),
        "edge.node_listen: an IPv6 address must be in brackets, e.g. [::1]:7071 (got '::1:7070')",
    ),
    (
        "empty host",
        set_in(["edge", "node_listen"], ":7070"),
        "edge.node_listen: the host is empty (use 0.0.0.0 or [::] to listen on every interface) (got ':7070')",
    ),
    # --- principal tokens
    (
        "duplicate token_ref",
        lambda d: d["openai"]["principal_tokens"][1].update(token_ref="app-1"),
        "openai.principal_tokens[1].token_ref: duplicate token_ref 'app-1' (first at openai.principal_tokens[0])",
    ),
    (
        "duplicate token hash",
        lambda d: d["openai"]["principal_tokens"][1].update(token_hash_sha256=P1),
        "openai.principal_tokens[1].token_hash_sha256: duplicate token hash (same as openai.principal_tokens[0])",
    ),
    (
        "principal hash uppercase",
        lambda d: d["openai"]["principal_tokens"][0].update(token_hash_sha256=P1.upper()),
        "openai.principal_tokens[0].token_hash_sha256: must be 64 lowercase hex characters "
        "(the SHA-256 of the token; see 'iopd token')",
    ),
    (
        "node hash too short",
        lambda d: d["nodes"][0].update(token_hash_sha256="abc"),
        "nodes[0].token_hash_sha256: must be 64 lowercase hex characters "
        "(the SHA-256 of the token; see 'iopd token')",
    ),
    (
        "empty principal_ref",
        lambda d: d["openai"]["principal_tokens"][0].update(principal_ref=""),
        "openai.principal_tokens[0].principal_ref: must not be empty",
    ),
    # --- type specific
    (
        "openai needs base_url",
        lambda d: prov(d, 0, 0).pop("base_url"),
        "nodes[0].providers[0].base_url: required for type 'openai' (an http:// or https:// URL)",
    ),
    (
        "ollama needs http base_url",
        lambda d: prov(d, 0, 0).update(type="ollama", base_url="ftp://host/"),
        "nodes[0].providers[0].base_url: must be an http:// or https:// URL with a host",
    ),
    (
        "base_url without host",
        lambda d: prov(d, 0, 0).update(base_url="http://"),
        "nodes[0].providers[0].base_url: must be an http:// or https:// URL with a host",
    ),
    (
        "cli needs command",
        lambda d: prov(d, 0, 1).pop("command"),
        "nodes[0].providers[1].command: required for type 'cli' (a non-empty argv list)",
    ),
    (
        "cli command empty list",
        lambda d: prov(d, 0, 1).update(command=[]),
        "nodes[0].providers[1].command: required for type 'cli' (a non-empty argv list)",
    ),
    (
        "cli empty program",
        lambda d: prov(d, 0, 1).update(command=[" ", "x"]),
        "nodes[0].providers[1].command[0]: the program must not be empty",
    ),
    (
        "provider needs models",
        lambda d: prov(d, 0, 1).update(models=[]),
        "nodes[0].providers[1].models: must list at least one served model name",
    ),
    (
        "empty provider id",
        lambda d: prov(d, 0, 1).update(id=""),
        "nodes[0].providers[1].id: must not be empty",
    ),
    # --- TLS
    (
        "tls cert without key",
        set_in(["edge", "tls"], {"cert": "/etc/iopd/cert.pem"}),
        "edge.tls.key: required when edge.tls.cert is set",
    ),
    (
        "tls key without cert",
        set_in(["edge", "tls"], {"key": "/etc/iopd/key.pem"}),
        "edge.tls.cert: required when edge.tls.key is set",
    ),
    (
        "client_ca without cert",
        set_in(["edge", "tls"], {"client_ca": "/etc/iopd/ca.pem"}),
        "edge.tls.client_ca: requires edge.tls.cert and edge.tls.key",
    ),
    (
        "provider_auth header name",
        set_in(["openai", "provider_auth", "header"], "bad header"),
        "openai.provider_auth.header: must be a valid HTTP header name",
    ),
    (
        "session header name",
        set_in(["openai", "session_header"], "bad header"),
        "openai.session_header: must be a valid HTTP header name",
    ),
    (
        "session header a credential",
        set_in(["openai", "session_header"], "X-Api-Key"),
        "openai.session_header: 'X-Api-Key' carries a credential or routing, never a session: "
        "it is a credential header",
    ),
    (
        "unsupported tools policy",
        set_in(["openai", "unsupported_tools"], "ignore"),
        "openai.unsupported_tools: must be one of 'drop', 'reject' (got 'ignore')",
    ),
    # --- legacy routes
    (
        "route unknown node",
        add_route(**{**ROUTE_OK, "node": "node-x"}),
        "openai.model_routes[0].node: node 'node-x' is not defined under nodes[]",
    ),
    (
        "route adapter not on node",
        add_route(**{**ROUTE_OK, "adapter": "echo-b", "target": "echo"}),
        "openai.model_routes[0].adapter: provider 'echo-b' is not defined on node 'node-a'",
    ),
    (
        "route adapter undefined",
        add_route(**{**ROUTE_OK, "adapter": "nope"}),
        "openai.model_routes[0].adapter: provider 'nope' is not defined under nodes[].providers",
    ),
    (
        "route target not served",
        add_route(**{**ROUTE_OK, "target": "m-b"}),
        "openai.model_routes[0].target: 'm-b' is not in the models of provider 'vllm-a'",
    ),
    (
        "route duplicate model",
        both(add_route(**ROUTE_OK), add_route(**ROUTE_OK)),
        "openai.model_routes[1].model: duplicate route model 'legacy' (first at openai.model_routes[0])",
    ),
    (
        "route queue_timeout > 0",
        add_route(**ROUTE_OK, queue_timeout=0),
        "openai.model_routes[0].queue_timeout: must be > 0 (got 0.0)",
    ),
    # --- single-target form
    (
        "adapter without target",
        set_in(["openai", "adapter"], "vllm-a"),
        "openai.target: required when openai.adapter is set",
    ),
    (
        "target without adapter",
        set_in(["openai", "target"], "m-a"),
        "openai.adapter: required when openai.target is set",
    ),
    (
        "single-target adapter undefined",
        both(set_in(["openai", "adapter"], "nope"), set_in(["openai", "target"], "m-a")),
        "openai.adapter: provider 'nope' is not defined under nodes[].providers",
    ),
    (
        "single-target adapter on other node",
        both(
            set_in(["openai", "node"], "node-b"),
            set_in(["openai", "adapter"], "vllm-a"),
            set_in(["openai", "target"], "m-a"),
        ),
        "openai.adapter: provider 'vllm-a' is not defined on node 'node-b'",
    ),
    (
        "single-target node undefined",
        both(
            set_in(["openai", "node"], "node-x"),
            set_in(["openai", "adapter"], "vllm-a"),
            set_in(["openai", "target"], "m-a"),
        ),
        "openai.node: node 'node-x' is not defined under nodes[]",
    ),
    (
        "single-target target not served",
        both(set_in(["openai", "adapter"], "vllm-a"), set_in(["openai", "target"], "zzz")),
        "openai.target: 'zzz' is not in the models of provider 'vllm-a'",
    ),
    (
        "single-target node alone",
        set_in(["openai", "node"], "node-a"),
        "openai.node: only meaningful with openai.adapter and openai.target",
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule(mutate: Mutation, expected: str) -> None:
    errors = errors_of(mutate)
    assert expected in errors, errors


NODE_CASES: list[tuple[str, Mutation, str]] = [
    ("node edge address", set_in(["node", "edge"], "edge.local"), "node.edge: must be host:port, e.g. 127.0.0.1:7070 (the port is missing) (got 'edge.local')"),
    ("node edge a URL", set_in(["node", "edge"], "http://127.0.0.1:8080"), "node.edge: must be host:port, not a URL (got 'http://127.0.0.1:8080'): write the address of the edge's edge.node_listen (the wire port, not the OpenAI port), e.g. 127.0.0.1:7070"),
    ("node token empty", set_in(["node", "token"], ""), "node.token: must not be empty"),
    ("node id empty", set_in(["node", "id"], " "), "node.id: must not be empty"),
    ("node id too long", set_in(["node", "id"], "n" * 1025), "node.id: must be at most 1024 characters (got 1025)"),
    ("node tls cert without key", set_in(["node", "tls"], {"cert": "c.pem"}), "node.tls.key: required when node.tls.cert is set"),
    ("node tls key without cert", set_in(["node", "tls"], {"key": "k.pem"}), "node.tls.cert: required when node.tls.key is set"),
    ("node backoff", set_in(["node", "reconnect_max_backoff"], 0), "node.reconnect_max_backoff: must be > 0 (got 0.0)"),
    (
        "node initial backoff above max",
        both(set_in(["node", "reconnect_initial_backoff"], 5), set_in(["node", "reconnect_max_backoff"], 1)),
        "node.reconnect_initial_backoff: must not exceed node.reconnect_max_backoff (1.0)",
    ),
    ("node drain", set_in(["node", "drain_timeout"], -1), "node.drain_timeout: must be > 0 (got -1.0)"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [c[1:] for c in NODE_CASES], ids=[c[0] for c in NODE_CASES]
)
def test_node_rule(mutate: Mutation, expected: str) -> None:
    errors = errors_of(mutate, NODE_BASE)
    assert expected in errors, errors


def test_valid_variants_pass() -> None:
    """Things that look unusual but are allowed."""
    ok: list[Mutation] = [
        # several principal tokens may share a principal_ref (BASE already does)
        lambda d: None,
        set_in(["edge", "admin_listen"], "[::1]:7071"),
        set_in(["edge", "admin_listen"], "localhost:0"),
        set_in(["edge", "admin_listen"], "127.8.9.10:7071"),
        set_in(["edge", "node_listen"], "[::]:7070"),
        set_in(["edge", "node_listen"], "edge.example.org:7070"),
        set_in(["edge", "tls"], {"cert": "c.pem", "key": "k.pem", "client_ca": "ca.pem"}),
        lambda d: prov(d, 0, 0).update(long_context_capacity=4),
        add_route(**ROUTE_OK, queue_timeout=3),
        both(set_in(["openai", "adapter"], "echo-b"), set_in(["openai", "target"], "echo")),
        both(
            set_in(["openai", "node"], "node-b"),
            set_in(["openai", "adapter"], "echo-b"),
            set_in(["openai", "target"], "echo"),
        ),
        set_in(["provider_pool", "max_queue"], 0),
    ]
    for mutate in ok:
        assert errors_of(mutate) == []


def test_every_problem_is_reported_at_once() -> None:
    def many(d: dict[str, Any]) -> None:
        d["edge"]["admin_listen"] = "0.0.0.0:1"
        prov(d, 0, 0)["capacity"] = 0
        d["models"][0]["providers"]["ghost"] = "x"
        d["nodes"][1]["id"] = "node-a"

    errors = errors_of(many)
    assert len(errors) == 4, errors


def test_secrets_are_not_echoed() -> None:
    secret = "s3cr3t-value-should-not-leak"
    errors = errors_of(
        lambda d: d["openai"]["principal_tokens"][0].update(token_hash_sha256=secret)
    )
    assert errors and not any(secret in e for e in errors)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:7070", ("127.0.0.1", 7070)),
        ("[::1]:0", ("::1", 0)),
        ("host.example:65535", ("host.example", 65535)),
    ],
)
def test_parse_host_port(address: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(address) == expected


@pytest.mark.parametrize(
    "address", ["", "host", "host:", "[::1]", "[nothex]:1", "a b:1", "h:-1", "h:1.5", "h:٣"]
)
def test_parse_host_port_rejects(address: str) -> None:
    with pytest.raises(ValueError):
        parse_host_port(address)


def test_loopback_hosts() -> None:
    assert is_loopback_host("localhost") and is_loopback_host("127.0.0.2")
    assert is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("10.0.0.1")
    assert not is_loopback_host("localhost.evil.com")


# ------------------------------------------------ node.edges and token_verifier

VERIFIER = scram.Verifier.create("t", iterations=scram.MIN_ITERATIONS).encode()


def _node_a(d: dict[str, Any]) -> dict[str, Any]:
    node: dict[str, Any] = d["nodes"][0]
    return node


def _use_verifier(d: dict[str, Any]) -> None:
    del _node_a(d)["token_hash_sha256"]
    _node_a(d)["token_verifier"] = VERIFIER


def _no_edge(d: dict[str, Any]) -> None:
    del d["node"]["edge"]


VERIFIER_CASES: list[tuple[str, Mutation, str]] = [
    (
        "both forms",
        lambda d: _node_a(d).update(token_verifier=VERIFIER),
        "nodes[0].token_hash_sha256: set token_verifier or token_hash_sha256, not both",
    ),
    (
        "bad verifier",
        both(_use_verifier, lambda d: _node_a(d).update(token_verifier="SCRAM-SHA-256$1:x")),
        "nodes[0].token_verifier: must have the form SCRAM-SHA-256$<iterations>:<base64 salt>"
        "$<base64 StoredKey>:<base64 ServerKey> (see 'iopd token')",
    ),
    (
        "neither form",
        lambda d: _node_a(d).pop("token_hash_sha256"),
        "nodes[0].token_hash_sha256: required for a node that dials in: this or, stronger, "
        "token_verifier (see 'iopd token'); or set embedded: true to run the node inside the edge",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [c[1:] for c in VERIFIER_CASES], ids=[c[0] for c in VERIFIER_CASES]
)
def test_node_entry_token_forms(mutate: Mutation, expected: str) -> None:
    assert expected in errors_of(mutate), errors_of(mutate)


def test_a_token_verifier_alone_is_valid() -> None:
    assert errors_of(_use_verifier) == []


NODE_EDGES_CASES: list[tuple[str, Mutation, str]] = [
    (
        "edge and edges",
        set_in(["node", "edges"], ["127.0.0.1:7070"]),
        "node.edges: set node.edge (one edge) or node.edges (several), not both",
    ),
    (
        "neither edge nor edges",
        _no_edge,
        "node.edge: required: the edge's host:port (or node.edges: a list, for several)",
    ),
    (
        "duplicate edges",
        both(_no_edge, set_in(["node", "edges"], ["a:1", "b:2", "A:1"])),
        "node.edges[2]: duplicate edge address (same as node.edges[0])",
    ),
    (
        "bad address in edges",
        both(_no_edge, set_in(["node", "edges"], ["a:1", "nope"])),
        "node.edges[1]: must be host:port",
    ),
    (
        "a URL in edges",
        both(_no_edge, set_in(["node", "edges"], ["https://[::1]/v1"])),
        "node.edges[0]: must be host:port, not a URL (got 'https://[::1]/v1'): write the address "
        "of the edge's edge.node_listen (the wire port, not the OpenAI port), e.g. [::1]:7070",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [c[1:] for c in NODE_EDGES_CASES],
    ids=[c[0] for c in NODE_EDGES_CASES],
)
def test_node_edges_rules(mutate: Mutation, expected: str) -> None:
    errors = errors_of(mutate, NODE_BASE)
    assert any(e.startswith(expected) for e in errors), errors


def test_node_edges_alone_is_valid() -> None:
    mutate = both(_no_edge, set_in(["node", "edges"], ["127.0.0.1:7070", "[::1]:7070"]))
    assert errors_of(mutate, NODE_BASE) == []
