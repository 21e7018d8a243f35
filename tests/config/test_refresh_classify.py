"""The refresh classifier: every live key, many restart-required paths, comparison by id."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from iopd.config.refresh_classify import RefreshDiff, classify
from tests.support.refresh_cases import BASE, H, Mutation, diff_of, load


def prov(d: dict[str, Any], n: int, j: int) -> dict[str, Any]:
    p: dict[str, Any] = d["nodes"][n]["providers"][j]
    return p


def section(d: dict[str, Any], name: str) -> dict[str, Any]:
    s: dict[str, Any] = d.setdefault(name, {})
    return s


def test_no_change_gives_empty_arrays() -> None:
    diff = classify(load(BASE), load(copy.deepcopy(BASE)))
    assert diff == RefreshDiff([], [], [], [])
    assert diff.is_empty and diff.live_ok


def test_reordering_lists_is_not_a_change() -> None:
    def reorder(d: dict[str, Any]) -> None:
        d["nodes"].reverse()
        d["nodes"][1]["providers"].reverse()
        d["models"][0]["providers"] = {"echo-b": "echo", "vllm-a": "m-a"}

    assert diff_of(reorder).is_empty


LIVE: list[tuple[str, Mutation, RefreshDiff]] = [
    ("capacity", lambda d: prov(d, 0, 0).update(capacity=8), RefreshDiff(["node-a"], ["vllm-a"], [], [])),
    (
        "long_context_capacity",
        lambda d: prov(d, 0, 0).update(long_context_capacity=2),
        RefreshDiff(["node-a"], ["vllm-a"], [], []),
    ),
    ("priority", lambda d: prov(d, 1, 0).update(priority=3), RefreshDiff(["node-b"], ["echo-b"], [], [])),
    ("enabled", lambda d: prov(d, 0, 1).update(enabled=False), RefreshDiff(["node-a"], ["vllm-b"], [], [])),
    (
        "two providers on two nodes",
        lambda d: (prov(d, 0, 1).update(capacity=2), prov(d, 1, 0).update(enabled=False)),
        RefreshDiff(["node-a", "node-b"], ["echo-b", "vllm-b"], [], []),
    ),
    (
        "model mapping changed",
        lambda d: d["models"][0]["providers"].pop("echo-b"),
        RefreshDiff([], [], ["g1"], []),
    ),
    (
        "model added",
        lambda d: d["models"].append({"id": "g3", "providers": {"echo-b": "echo"}}),
        RefreshDiff([], [], ["g3"], []),
    ),
    ("model removed", lambda d: d["models"].pop(0), RefreshDiff([], [], ["g1"], [])),
    (
        "model generation",
        lambda d: d["models"][1].update(generation={"limits": {"max_tokens": 10}}),
        RefreshDiff([], [], ["g2"], []),
    ),
    (
        "model renamed",
        lambda d: d["models"][1].update(id="g9"),
        RefreshDiff([], [], ["g2", "g9"], []),
    ),
    ("max_queue", lambda d: section(d, "provider_pool").update(max_queue=1), RefreshDiff([], [], [], [])),
    (
        "max_queued_bytes",
        lambda d: section(d, "provider_pool").update(max_queued_bytes=1),
        RefreshDiff([], [], [], []),
    ),
    (
        "pool queue_timeout",
        lambda d: section(d, "provider_pool").update(queue_timeout=3),
        RefreshDiff([], [], [], []),
    ),
    (
        "threshold",
        lambda d: d["openai"].update(long_context_threshold_tokens=5),
        RefreshDiff([], [], [], []),
    ),
    ("strict_output", lambda d: d["openai"].update(strict_output=True), RefreshDiff([], [], [], [])),
    (
        "strict_output_instruction",
        lambda d: d["openai"].update(strict_output_instruction="x"),
        RefreshDiff([], [], [], []),
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), [c[1:] for c in LIVE], ids=[c[0] for c in LIVE])
def test_live_changes(mutate: Mutation, expected: RefreshDiff) -> None:
    diff = diff_of(mutate)
    assert diff == expected
    assert diff.live_ok


def add_node(d: dict[str, Any]) -> None:
    d["nodes"].append(
        {
            "id": "node-c",
            "token_hash_sha256": H[3],
            "providers": [{"id": "echo-c", "type": "echo", "models": ["echo"]}],
        }
    )


def make_embedded(d: dict[str, Any]) -> None:
    d["nodes"][1].update(embedded=True, token_hash_sha256="")


def move_provider(d: dict[str, Any]) -> None:
    p = d["nodes"][0]["providers"].pop(1)
    d["nodes"][1]["providers"].append(p)


RESTART: list[tuple[str, Mutation, list[str]]] = [
    ("edge.id", lambda d: d["edge"].update(id="e2"), ["edge.id"]),
    ("node_listen", lambda d: d["edge"].update(node_listen="127.0.0.1:1"), ["edge.node_listen"]),
    ("admin_listen", lambda d: d["edge"].update(admin_listen="127.0.0.1:2"), ["edge.admin_listen"]),
    ("drain", lambda d: d["edge"].update(drain_timeout=1), ["edge.drain_timeout"]),
    ("log_level", lambda d: d["edge"].update(log_level="debug"), ["edge.log_level"]),
    ("heartbeat", lambda d: d["edge"].update(heartbeat_interval=1), ["edge.heartbeat_interval"]),
    ("frame", lambda d: d["edge"].update(max_frame_bytes=10**8), ["edge.max_frame_bytes"]),
    (
        "edge tls",
        lambda d: d["edge"].update(tls={"cert": "c", "key": "k"}),
        ["edge.tls.cert", "edge.tls.key"],
    ),
    ("openai.listen", lambda d: d["openai"].update(listen="127.0.0.1:9"), ["openai.listen"]),
    ("openai.enabled", lambda d: d["openai"].update(enabled=False), ["openai.enabled"]),
    (
        "provider_auth",
        lambda d: d["openai"].update(provider_auth={"required": True}),
        ["openai.provider_auth.required"],
    ),
    ("routes", lambda d: d["openai"]["model_routes"].clear(), ["openai.model_routes"]),
    (
        "route queue_timeout",
        lambda d: d["openai"]["model_routes"][0].update(queue_timeout=4),
        ["openai.model_routes"],
    ),
    (
        "single target",
        lambda d: d["openai"].update(adapter="echo-b", target="echo"),
        ["openai.adapter", "openai.target"],
    ),
    ("max_body", lambda d: d["openai"].update(max_body_bytes=10), ["openai.max_body_bytes"]),
    ("request_timeout", lambda d: d["openai"].update(request_timeout=1), ["openai.request_timeout"]),
    ("max_connections", lambda d: d["openai"].update(max_connections=8), ["openai.max_connections"]),
    (
        "max_inflight_body_bytes",
        lambda d: d["openai"].update(max_inflight_body_bytes=1 << 30),
        ["openai.max_inflight_body_bytes"],
    ),
    ("send_timeout", lambda d: d["openai"].update(send_timeout=5), ["openai.send_timeout"]),
    (
        "embedded node added",
        lambda d: d["nodes"].append(
            {"id": "node-e", "embedded": True, "providers": [{"id": "echo-e", "type": "echo", "models": ["e"]}]}
        ),
        ["nodes[node-e]"],
    ),
    ("node made embedded", make_embedded, ["nodes[1].embedded"]),
    ("base_url", lambda d: prov(d, 0, 1).update(base_url="http://h:3"), ["nodes[0].providers[1].base_url"]),
    ("type", lambda d: prov(d, 0, 1).update(type="ollama"), ["nodes[0].providers[1].type"]),
    ("category", lambda d: prov(d, 0, 0).update(category="api"), ["nodes[0].providers[0].category"]),
    ("api_key", lambda d: prov(d, 0, 0).update(api_key="k"), ["nodes[0].providers[0].api_key"]),
    ("read_timeout", lambda d: prov(d, 1, 0).update(read_timeout=1), ["nodes[1].providers[0].read_timeout"]),
    (
        "first_byte_timeout",
        lambda d: prov(d, 1, 0).update(first_byte_timeout=5),
        ["nodes[1].providers[0].first_byte_timeout"],
    ),
    ("delay_ms", lambda d: prov(d, 1, 0).update(delay_ms=5), ["nodes[1].providers[0].delay_ms"]),
    (
        "lifecycle flags",
        lambda d: prov(d, 1, 0).update(lifecycle_capabilities=["streaming"]),
        ["nodes[1].providers[0].lifecycle_capabilities"],
    ),
    (
        "paths use the new index",
        lambda d: (d["nodes"].reverse(), prov(d, 0, 0).update(delay_ms=1)),
        ["nodes[0].providers[0].delay_ms"],
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), [c[1:] for c in RESTART], ids=[c[0] for c in RESTART])
def test_restart_required(mutate: Mutation, expected: list[str]) -> None:
    diff = diff_of(mutate)
    assert diff.restart_required == expected
    assert not diff.live_ok


def test_live_and_restart_changes_are_reported_together() -> None:
    def both(d: dict[str, Any]) -> None:
        prov(d, 0, 0).update(capacity=1, base_url="http://h:9")
        d["models"][1]["generation"] = {"defaults": {"temperature": 0.1}}
        d["edge"]["log_format"] = "json"

    diff = diff_of(both)
    assert diff == RefreshDiff(
        changed_nodes=["node-a"],
        changed_providers=["vllm-a"],
        changed_models=["g2"],
        restart_required=["edge.log_format", "nodes[0].providers[0].base_url"],
    )


def test_report_never_contains_secret_values() -> None:
    diff = diff_of(lambda d: (d["openai"].update(bearer_token="SECRET-7f3a91c2"), prov(d, 0, 0).update(api_key="KEY")))
    assert diff.restart_required == ["nodes[0].providers[0].api_key"]
    assert "SECRET" not in repr(diff) and "KEY" not in repr(diff)


def rotate_token(d: dict[str, Any]) -> None:
    d["openai"]["principal_tokens"][0].update(token_ref="app-1b", token_hash_sha256=H[5])


def remove_node_b(d: dict[str, Any]) -> None:
    d["nodes"].pop(1)
    d["models"][0]["providers"].pop("echo-b")


def remove_vllm_b(d: dict[str, Any]) -> None:
    d["nodes"][0]["providers"].pop(1)
    d["models"].pop(1)


NOW_LIVE: list[tuple[str, Mutation, RefreshDiff]] = [
    ("bearer", lambda d: d["openai"].update(bearer_token="t"), RefreshDiff()),
    ("principal alias", lambda d: d["openai"]["principal_tokens"][0].update(alias="x"), RefreshDiff()),
    ("principal token rotated", rotate_token, RefreshDiff()),
    (
        "principal token added",
        lambda d: d["openai"]["principal_tokens"].append(
            {"token_ref": "app-2", "token_hash_sha256": H[5], "principal_ref": "u2"}
        ),
        RefreshDiff(),
    ),
    ("principal tokens removed", lambda d: d["openai"]["principal_tokens"].clear(), RefreshDiff()),
    ("node added", add_node, RefreshDiff(["node-c"], ["echo-c"], [], [], added_nodes=["node-c"])),
    ("node removed", remove_node_b, RefreshDiff(["node-b"], ["echo-b"], ["g1"], [], removed_nodes=["node-b"])),
    (
        "node verifier",
        lambda d: d["nodes"][1].update(token_hash_sha256=H[4]),
        RefreshDiff(verifier_changed=["node-b"]),
    ),
    ("node alias", lambda d: d["nodes"][0].update(alias="box"), RefreshDiff()),
    (
        "provider added",
        lambda d: d["nodes"][1]["providers"].append({"id": "echo-x", "type": "echo", "models": ["e"]}),
        RefreshDiff(["node-b"], ["echo-x"], [], []),
    ),
    ("provider removed", remove_vllm_b, RefreshDiff(["node-a"], ["vllm-b"], ["g2"], [])),
    ("provider moved", move_provider, RefreshDiff(["node-a", "node-b"], ["vllm-b"], [], [])),
    (
        "served models",
        lambda d: prov(d, 0, 0).update(models=["m-a", "m-z"]),
        RefreshDiff(["node-a"], ["vllm-a"], [], []),
    ),
]


@pytest.mark.parametrize(("mutate", "expected"), [c[1:] for c in NOW_LIVE], ids=[c[0] for c in NOW_LIVE])
def test_tokens_nodes_and_their_providers_change_live(mutate: Mutation, expected: RefreshDiff) -> None:
    diff = diff_of(mutate)
    assert diff == expected
    assert diff.live_ok


def test_a_removed_embedded_node_needs_a_restart() -> None:
    base = copy.deepcopy(BASE)
    make_embedded(base)
    new = copy.deepcopy(base)
    remove_node_b(new)
    diff = classify(load(base), load(new))
    assert diff.restart_required == ["nodes[node-b]"]


def test_a_new_config_revision_is_live_and_pushes_every_node() -> None:
    """Several edges: a node applies the highest revision it has
    seen, so a raised ``edge.config_revision`` goes to every node, changed or not."""
    diff = diff_of(lambda d: d["edge"].update(config_revision=4))
    assert diff == RefreshDiff(["node-a", "node-b"], [], [], [])
    assert diff.live_ok
