"""Loading: YAML, ${NAME} substitution, structural errors at their paths, example configs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from iopd.config.load import (
    ConfigError,
    load_any_config,
    load_edge_config,
    load_node_config,
    parse_any_config,
    parse_edge_config,
    parse_node_config,
)
from iopd.config.schema import DEFAULT_STRICT_OUTPUT_INSTRUCTION, EdgeConfig, NodeConfigFile
from tests.support.example_configs import CONFIGS, EXAMPLE_ENV, filled_example, write_filled_example
from wire import scram

H = hashlib.sha256(b"x").hexdigest()

MINIMAL = f"""
edge:
  id: e1
  node_listen: 127.0.0.1:7070
  admin_listen: 127.0.0.1:7071
nodes:
  - id: n1
    token_hash_sha256: {H}
    providers:
      - id: echo-1
        type: echo
        models: [echo]
models:
  - id: echo
    providers: {{echo-1: echo}}
"""


def errors(text: str, env: dict[str, str] | None = None, *, node: bool = False) -> list[str]:
    parse = parse_node_config if node else parse_edge_config
    with pytest.raises(ConfigError) as info:
        parse(text, env=env or {})
    assert all(isinstance(e, str) and ": " in e and "\n" not in e for e in info.value.errors)
    return info.value.errors


# ------------------------------------------------------------------ basics


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_edge_config(MINIMAL, env={})
    assert cfg.edge.drain_timeout == 30.0
    assert cfg.edge.max_frame_bytes == 16 * 1024 * 1024
    assert cfg.openai.listen == "127.0.0.1:8080"
    assert cfg.openai.strict_output_instruction == DEFAULT_STRICT_OUTPUT_INSTRUCTION
    assert cfg.provider_pool.max_queue == 256
    p = cfg.nodes[0].providers[0]
    assert (p.capacity, p.long_context_capacity, p.priority, p.enabled) == (1, 0, 0, True)
    assert p.category == "local_inference"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_example_config_loads_once_its_secrets_are_filled_in(
    name: str, tmp_path: Path
) -> None:
    cfg = load_any_config(write_filled_example(name, tmp_path), env=EXAMPLE_ENV)
    assert isinstance(cfg, EdgeConfig | NodeConfigFile)


@pytest.mark.parametrize("name", ["edge.yaml", "node.yaml", "demo.yaml", "demo-node.yaml"])
def test_an_example_config_left_unchanged_is_refused(name: str) -> None:
    """Each secret an example leaves out is one line naming it and ``iopd token``."""
    with pytest.raises(ConfigError) as info:
        load_any_config(CONFIGS / name, env={})
    assert info.value.errors
    for line in info.value.errors:
        assert "token" in line.split(":", 1)[0], line
        assert "iopd token" in line or "IOP_NODE_TOKEN" in line, line


def test_example_configs_cover_the_expected_files() -> None:
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"edge.yaml", "node.yaml", "demo.yaml", "demo-node.yaml"} <= names


def test_demo_configs_match_each_other(tmp_path: Path) -> None:
    edge = load_edge_config(write_filled_example("demo.yaml", tmp_path), env=EXAMPLE_ENV)
    node = load_node_config(CONFIGS / "demo-node.yaml", env=EXAMPLE_ENV)
    assert edge.edge.id == "demo-edge"
    assert edge.openai.principal_tokens == [] and edge.openai.bearer_token is None
    (entry,) = edge.nodes
    assert entry.id == node.node.id == "demo-node"
    assert scram.Verifier.parse(entry.token_verifier).iterations >= scram.MIN_ITERATIONS
    assert node.node.token == EXAMPLE_ENV["IOP_NODE_TOKEN"]
    assert node.node.edge == edge.edge.node_listen == "127.0.0.1:7070"
    (p,) = entry.providers
    assert (p.id, p.type, p.models, p.capacity, p.delay_ms, p.category) == (
        "echo-1", "echo", ["echo"], 4, 20, "api",
    )
    assert edge.models[0].id == "echo" and edge.models[0].providers == {"echo-1": "echo"}


def test_example_edge_config_uses_every_provider_type() -> None:
    cfg = parse_edge_config(filled_example("edge.yaml"), env={})
    types = {p.type for n in cfg.nodes for p in n.providers}
    assert types == {"openai", "ollama", "cli", "echo"}
    assert len(cfg.nodes) == 2 and len(cfg.openai.principal_tokens) == 2
    assert cfg.openai.model_routes
    # Optional secrets default to "not set".
    assert cfg.openai.bearer_token is None
    assert cfg.edge.tls.cert is None and cfg.edge.tls.key is None


def test_load_any_detects_node_config() -> None:
    cfg = parse_any_config("node: {id: n, edge: 'h:1', token: t}", env={})
    assert isinstance(cfg, NodeConfigFile)
    with pytest.raises(ConfigError) as info:
        parse_any_config("something: 1", env={})
    assert info.value.errors == [
        "(document): expected a top-level key 'edge' (edge config) or 'node' (node config)"
    ]


# --------------------------------------------------------- substitution


def test_env_set_default_and_empty_default() -> None:
    text = MINIMAL.replace("id: e1", "id: ${EDGE_ID}").replace(
        "admin_listen: 127.0.0.1:7071",
        "admin_listen: 127.0.0.1:${ADMIN_PORT:-7071}\n  log_level: ${LOG_LEVEL:-}",
    ) + "openai:\n  bearer_token: ${IOP_BEARER_TOKEN:-}\n"
    cfg = parse_edge_config(text, env={"EDGE_ID": "edge-from-env"})
    assert cfg.edge.id == "edge-from-env"
    assert cfg.edge.admin_listen == "127.0.0.1:7071"
    assert cfg.edge.log_level == "info"  # empty -> not set -> default
    assert cfg.openai.bearer_token is None
    cfg = parse_edge_config(
        text,
        env={"EDGE_ID": "x", "ADMIN_PORT": "9", "IOP_BEARER_TOKEN": "tok", "LOG_LEVEL": "debug"},
    )
    assert cfg.edge.admin_listen == "127.0.0.1:9"
    assert cfg.openai.bearer_token == "tok"
    assert cfg.edge.log_level == "debug"


def test_env_set_to_empty_string_wins_over_default() -> None:
    text = MINIMAL + "openai:\n  bearer_token: ${TOK:-fallback}\n"
    assert parse_edge_config(text, env={"TOK": ""}).openai.bearer_token is None
    assert parse_edge_config(text, env={}).openai.bearer_token == "fallback"


def test_env_missing_without_default_names_the_path() -> None:
    text = MINIMAL.replace(f"token_hash_sha256: {H}", "token_hash_sha256: ${NODE_HASH}")
    assert errors(text) == [
        "nodes[0].token_hash_sha256: environment variable NODE_HASH is not set and has no default"
    ]


def test_env_in_numbers_and_booleans() -> None:
    text = MINIMAL.replace(
        "models: [echo]", "models: [echo]\n        capacity: ${CAP:-3}\n        enabled: ${ON:-true}"
    )
    cfg = parse_edge_config(text, env={})
    assert cfg.nodes[0].providers[0].capacity == 3 and cfg.nodes[0].providers[0].enabled is True
    cfg = parse_edge_config(text, env={"CAP": "7", "ON": "false"})
    assert cfg.nodes[0].providers[0].capacity == 7 and cfg.nodes[0].providers[0].enabled is False
    assert errors(text, {"CAP": "lots"}) == [
        "nodes[0].providers[0].capacity: expected an integer, got string"
    ]


def test_env_in_lists_and_mapping_values() -> None:
    text = MINIMAL.replace("models: [echo]", "models: ['${SERVED:-echo}']")
    cfg = parse_edge_config(text, env={})
    assert cfg.nodes[0].providers[0].models == ["echo"]
    assert errors(text, {"SERVED": "other"}) == [
        "models[0].providers.echo-1: served model 'echo' is not in the models of provider 'echo-1'"
    ]


def test_env_value_is_not_expanded_twice() -> None:
    text = MINIMAL + "openai:\n  bearer_token: ${TOK}\n"
    cfg = parse_edge_config(text, env={"TOK": "a${B}c"})
    assert cfg.openai.bearer_token == "a${B}c"


def test_required_key_empty_after_substitution() -> None:
    text = "node: {id: n, edge: 'h:1', token: '${IOP_NODE_TOKEN:-}'}"
    assert errors(text, node=True) == [
        "node.token: required key is empty after ${...} substitution"
    ]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("${}", "malformed environment reference (use ${NAME} or ${NAME:-default})"),
        ("${1ABC}", "malformed environment reference (use ${NAME} or ${NAME:-default})"),
        ("${ABC", "unterminated environment reference '${' (missing '}')"),
    ],
)
def test_malformed_references(value: str, reason: str) -> None:
    text = MINIMAL + f"openai:\n  bearer_token: '{value}'\n"
    assert errors(text) == [f"openai.bearer_token: {reason}"]


def test_environment_values_never_appear_in_errors() -> None:
    text = MINIMAL + "openai:\n  principal_tokens:\n    - {token_ref: a, principal_ref: p, token_hash_sha256: '${H}'}\n"
    errs = errors(text, {"H": "super-secret-hash-value"})
    assert errs and not any("super-secret" in e for e in errs)


# ------------------------------------------------------- structural errors


def test_unknown_keys_are_errors_at_their_path() -> None:
    text = MINIMAL.replace("type: echo", "type: echo\n        capacty: 3") + "extra: 1\n"
    errs = errors(text)
    assert len(errs) == 2
    assert errs[0].startswith("nodes[0].providers[0].capacty: unknown key (known keys here: ")
    assert "capacity" in errs[0]
    assert errs[1].startswith("extra: unknown key")


def test_missing_required_keys() -> None:
    errs = errors("edge: {id: e}\n")
    assert errs == [
        "edge.node_listen: required key is missing",
        "edge.admin_listen: required key is missing",
    ]
    assert errors("openai: {}\n") == ["edge: required key is missing"]


def test_wrong_types_and_enum_values() -> None:
    text = (
        MINIMAL.replace("type: echo", "type: teleport")
        .replace("id: e1", "id: [1]")
        .replace("admin_listen: 127.0.0.1:7071", "admin_listen: 127.0.0.1:7071\n  drain_timeout: soon\n  log_format: xml")
    )
    errs = errors(text)
    assert "edge.id: expected a string, got list" in errs
    assert "edge.drain_timeout: expected a number, got string" in errs
    assert "edge.log_format: must be one of 'json', 'keyvalue' (got 'xml')" in errs
    assert (
        "nodes[0].providers[0].type: must be one of 'cli', 'echo', 'ollama', 'openai' (got 'teleport')"
        in errs
    )
    assert len(errs) == 4  # a bad type adds no noise about type-specific keys


def test_booleans_are_not_numbers_and_numbers_not_strings() -> None:
    text = MINIMAL.replace("models: [echo]", "models: [echo]\n        capacity: true") + (
        "openai: {bearer_token: 12345}\n"
    )
    errs = errors(text)
    assert errs == [  # in document order
        "nodes[0].providers[0].capacity: expected an integer, got boolean",
        "openai.bearer_token: expected a string or null, got integer",
    ]


def test_structural_and_semantic_errors_together() -> None:
    text = MINIMAL.replace("admin_listen: 127.0.0.1:7071", "admin_listen: 10.0.0.1:7071\n  bogus: 1")
    errs = errors(text)
    assert errs[0].startswith("edge.bogus: unknown key")
    assert errs[1].startswith("edge.admin_listen: must be a loopback address")


def test_odd_keys_are_quoted_in_paths() -> None:
    text = MINIMAL.replace("providers: {echo-1: echo}", "providers: {echo-1: echo, 'a b': x, 3: y}")
    errs = errors(text)
    assert 'models[0].providers[3]: key must be a string, got integer' in errs
    assert 'models[0].providers["a b"]: provider \'a b\' is not defined under nodes[].providers' in errs


def test_list_item_of_wrong_shape() -> None:
    text = MINIMAL.replace("models:\n  - id: echo", "models:\n  - 42\n  - id: echo")
    assert errors(text) == ["models[0]: expected a mapping, got integer"]


# --------------------------------------------------------- document level


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "(document): the config is empty (expected a mapping with key 'edge')"),
        ("- 1\n- 2\n", "(document): expected a mapping with key 'edge' at the top level, got list"),
        ("just text", "(document): expected a mapping with key 'edge' at the top level, got string"),
    ],
)
def test_top_level_not_a_mapping(text: str, expected: str) -> None:
    assert errors(text) == [expected]


def test_yaml_syntax_error_names_line_and_column() -> None:
    (err,) = errors("edge:\n  id: [unclosed\n")
    assert err.startswith("(document): YAML syntax error at line ")


def test_binary_junk_is_an_error_not_a_traceback() -> None:
    (err,) = errors("\x00\x01\x02edge")
    assert err.startswith("(document): YAML syntax error")


def test_recursive_alias_does_not_hang() -> None:
    text = "edge: &a\n  id: e\n  node_listen: 127.0.0.1:1\n  admin_listen: 127.0.0.1:2\n  tls: *a\n"
    errs = errors(text)
    assert any(e.startswith("edge.tls.id: unknown key") for e in errs)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_edge_config(tmp_path / "nope.yaml")
    (err,) = info.value.errors
    assert err.startswith("(file): cannot read ") and "nope.yaml" in err


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"edge:\n  id: \xff\xfe\n")
    with pytest.raises(ConfigError) as info:
        load_any_config(path)
    assert info.value.errors == [f"(file): {path} is not UTF-8 text (byte offset 12)"]


def test_config_error_str_lists_every_error() -> None:
    exc = ConfigError(["a: x", "b: y"], source="f.yaml")
    assert str(exc) == "f.yaml: 2 config errors\n  a: x\n  b: y"
    assert exc.errors == ["a: x", "b: y"]


def test_node_config_defaults() -> None:
    cfg = parse_node_config("node: {id: n, edge: 'edge.local:7070', token: t}", env={})
    assert cfg.node.reconnect_max_backoff == 30.0
    assert cfg.node.tls.ca is None


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("  id: 2024-01-01", "edge.id: expected a string, got date"),
        ("  id: !!binary aGVsbG8=", "edge.id: expected a string, got bytes"),
        ("  tls: !!set {a, b}", "edge.tls: expected a mapping, got set"),
    ],
)
def test_yaml_tags_become_type_errors(snippet: str, expected: str) -> None:
    text = "edge:\n  node_listen: 127.0.0.1:1\n  admin_listen: 127.0.0.1:2\n" + snippet + "\n"
    if "id:" not in snippet:
        text += "  id: e\n"
    assert expected in errors(text)


def test_unsafe_yaml_tags_are_rejected() -> None:
    (err,) = errors("edge: !!python/object/apply:os.system ['true']\n")
    assert err.startswith("(document): YAML syntax error")


def test_deeply_nested_yaml_is_an_error() -> None:
    (err,) = errors("edge: " + "[" * 5000 + "]" * 5000 + "\n")
    assert err.startswith("(document): ")
