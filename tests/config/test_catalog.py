"""The catalog: models[], legacy routes and the single-target fallback; NodeConfig pushes."""

from __future__ import annotations

import hashlib

import msgspec
import pytest

from iopd.config.catalog import Catalog, GroupSpec, build_catalog, node_config_for
from iopd.config.load import parse_edge_config
from iopd.config.schema import Generation
from tests.support.example_configs import filled_example
from wire.messages import NodeConfig, ProviderSpec

H = hashlib.sha256(b"n").hexdigest()
H2 = hashlib.sha256(b"m").hexdigest()

LEGACY = f"""
edge: {{id: e, node_listen: "127.0.0.1:7070", admin_listen: "127.0.0.1:7071"}}
openai:
  model_routes:
    - {{model: fast, node: node-a, adapter: vllm-a, target: m-a, queue_timeout: 2.5}}
    - {{model: shared, node: node-b, adapter: echo-b, target: echo}}
    - {{model: cli, node: node-a, adapter: cli-a, target: codex}}
  adapter: echo-b
  target: echo
models:
  - id: shared
    providers: {{vllm-a: m-a, echo-b: echo}}
    generation: {{defaults: {{temperature: 0.2}}, limits: {{max_tokens: 100}}}}
  - id: zeta
    providers: {{cli-a: codex}}
nodes:
  - id: node-a
    token_hash_sha256: {H}
    providers:
      - {{id: vllm-a, type: openai, base_url: "http://127.0.0.1:8000", models: [m-a], capacity: 3, api_key: k}}
      - {{id: cli-a, type: cli, command: [codex, exec, "-"], models: [codex], kill_grace: 2, priority: 4}}
  - id: node-b
    token_hash_sha256: {H2}
    providers:
      - {{id: echo-b, type: echo, models: [echo], delay_ms: 7, enabled: false}}
"""


@pytest.fixture
def catalog() -> Catalog:
    return build_catalog(parse_edge_config(LEGACY, env={}))


def resolved(cat: Catalog, model: str) -> GroupSpec:
    group = cat.resolve(model)
    assert group is not None
    return group


def test_models_win_over_routes_and_keep_order(catalog: Catalog) -> None:
    assert list(catalog.groups) == ["shared", "zeta", "fast", "cli"]
    shared = resolved(catalog, "shared")
    assert shared.source == "models"
    assert shared.providers == (("vllm-a", "m-a"), ("echo-b", "echo"))
    assert shared.generation == Generation(defaults={"temperature": 0.2}, limits={"max_tokens": 100})
    assert shared.queue_timeout is None


def test_route_becomes_one_provider_group_with_its_queue_timeout(catalog: Catalog) -> None:
    assert resolved(catalog, "fast") == GroupSpec(
        id="fast",
        providers=(("vllm-a", "m-a"),),
        queue_timeout=2.5,
        generation=Generation(),
        source="route",
    )
    assert resolved(catalog, "cli").queue_timeout is None


def test_fallback_catches_every_other_model(catalog: Catalog) -> None:
    for model in ("echo", "anything", ""):
        g = resolved(catalog, model)
        assert g.source == "fallback" and g.id == "echo"
        assert g.providers == (("echo-b", "echo"),)


def test_listing_order_has_no_duplicates(catalog: Catalog) -> None:
    assert [(g.id, g.source) for g in catalog.listed()] == [
        ("shared", "models"),
        ("zeta", "models"),
        ("fast", "route"),
        ("cli", "route"),
        ("echo", "fallback"),
    ]


def test_fallback_named_like_a_group_is_listed_once() -> None:
    text = LEGACY.replace("adapter: echo-b\n  target: echo", "adapter: vllm-a\n  target: m-a")
    text = text.replace("- id: zeta", "- id: m-a")
    cat = build_catalog(parse_edge_config(text, env={}))
    ids = [g.id for g in cat.listed()]
    assert ids.count("m-a") == 1
    assert resolved(cat, "m-a").source == "models"
    assert resolved(cat, "unknown").source == "fallback"


def test_without_fallback_unknown_models_resolve_to_none() -> None:
    text = LEGACY.replace("  adapter: echo-b\n  target: echo\n", "")
    cat = build_catalog(parse_edge_config(text, env={}))
    assert cat.fallback is None
    assert cat.resolve("nope") is None
    assert cat.group("nope") is None
    assert [g.id for g in cat.listed()] == ["shared", "zeta", "fast", "cli"]


def test_has_type(catalog: Catalog) -> None:
    assert catalog.has_type("shared", "openai") and catalog.has_type("shared", "echo")
    assert not catalog.has_type("shared", "cli")
    assert catalog.has_type("zeta", "cli")
    assert catalog.has_type("echo", "echo")  # the fallback by its id
    assert not catalog.has_type("missing", "echo")


def test_provider_index(catalog: Catalog) -> None:
    assert set(catalog.providers) == {"vllm-a", "cli-a", "echo-b"}
    ref = catalog.providers["echo-b"]
    assert ref.node_id == "node-b" and ref.config.delay_ms == 7


def test_catalog_is_immutable(catalog: Catalog) -> None:
    with pytest.raises(TypeError):
        catalog.groups["new"] = resolved(catalog, "shared")  # type: ignore[index]
    with pytest.raises(TypeError):
        catalog.providers["x"] = catalog.providers["vllm-a"]  # type: ignore[index]
    with pytest.raises(AttributeError):
        catalog.fallback = None  # type: ignore[misc]


def test_node_config_for_maps_provider_settings() -> None:
    cfg = parse_edge_config(LEGACY, env={})
    msg = node_config_for(cfg, "node-a", version=3, stream_id=9)
    assert isinstance(msg, NodeConfig)
    assert (msg.stream_id, msg.version) == (9, 3)
    assert [p.id for p in msg.providers] == ["vllm-a", "cli-a"]
    vllm, cli = msg.providers
    assert vllm == ProviderSpec(
        id="vllm-a",
        type="openai",
        models=["m-a"],
        base_url="http://127.0.0.1:8000",
        api_key="k",
        capacity=3,
    )
    assert cli.command == ["codex", "exec", "-"] and cli.kill_grace == 2.0
    # Edge-only policy is not pushed; the message round-trips on the wire.
    assert not hasattr(cli, "priority")
    raw = msgspec.msgpack.encode(msg)
    assert msgspec.msgpack.decode(raw, type=NodeConfig) == msg
    # The push never aliases the running config.
    cli.command.append("x")
    assert cfg.nodes[0].providers[1].command == ["codex", "exec", "-"]


def test_node_config_for_disabled_provider_and_defaults() -> None:
    cfg = parse_edge_config(LEGACY, env={})
    msg = node_config_for(cfg, "node-b", version=1)
    assert msg.stream_id == 0
    (echo,) = msg.providers
    assert (echo.id, echo.type, echo.delay_ms) == ("echo-b", "echo", 7)


def test_node_config_for_unknown_node() -> None:
    cfg = parse_edge_config(LEGACY, env={})
    with pytest.raises(KeyError):
        node_config_for(cfg, "node-x", version=1)


def test_example_edge_config_catalog() -> None:
    cat = build_catalog(parse_edge_config(filled_example("edge.yaml"), env={}))
    assert [g.id for g in cat.listed()] == ["qwen3:32b", "coder", "echo", "echo-legacy"]
    assert resolved(cat, "echo-legacy").queue_timeout == 5.0
    assert cat.has_type("qwen3:32b", "openai") and cat.has_type("qwen3:32b", "ollama")
