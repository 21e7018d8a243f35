"""The one builder of edge configs for in-process tests: YAML text from a few parts.

Most tests run one edge with one echo node (``node-a``, provider ``echo-1``
serving model ``echo``) and change only what they pin: a capacity, a timeout,
a principal token.  ``edge_yaml`` gives that config with every section
overridable; ``echo_provider``, ``node`` and ``model`` build the parts.  The
result is plain YAML (``yaml.safe_dump``), as an operator would write it.

The surface tests compose configs from YAML text instead (``gateway_yaml`` of
``node_entry`` and ``http_provider``/``cli_provider`` entries; ``echo_yaml``
and ``ollama_yaml`` for one node): kept here so that no test file holds a copy.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from tests.support.gateway import (
    node_token,
    token_hash,
)


def py_command(script: str) -> str:
    """A ``cli`` provider ``command`` (YAML flow list) running ``script`` with this Python."""
    return json.dumps([sys.executable, "-c", script])


#: A loopback listener on a free port.
ANY_PORT = "127.0.0.1:0"


def echo_provider(
    pid: str = "echo-1",
    *,
    models: Iterable[str] = ("echo",),
    capacity: int = 4,
    category: str | None = "api",
    **fields: Any,
) -> dict[str, Any]:
    """An echo provider (``category`` None leaves the schema's default)."""
    spec: dict[str, Any] = {"id": pid, "type": "echo"}
    if category is not None:
        spec["category"] = category
    spec.update(models=list(models), capacity=capacity, **fields)
    return spec


def node(
    node_id: str = "node-a", providers: list[dict[str, Any]] | None = None, **fields: Any
) -> dict[str, Any]:
    """A ``nodes[]`` entry whose token is ``node_token(node_id)``."""
    entry: dict[str, Any] = {"id": node_id, **fields}
    entry["token_hash_sha256"] = token_hash(node_token(node_id))
    entry["providers"] = providers if providers is not None else [echo_provider()]
    return entry


def model(model_id: str = "echo", providers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A ``models[]`` entry: provider id -> the provider's own model name."""
    return {"id": model_id, "providers": dict(providers or {"echo-1": model_id})}


def principal_token(
    token: str, token_ref: str = "app-1", principal_ref: str = "user-1"
) -> dict[str, str]:
    """An ``openai.principal_tokens`` entry for ``token``."""
    return {
        "token_ref": token_ref,
        "token_hash_sha256": token_hash(token),
        "principal_ref": principal_ref,
    }


def edge_yaml(
    *,
    edge_id: str = "edge-test",
    edge: Mapping[str, Any] | None = None,
    openai: Mapping[str, Any] | None = None,
    provider_pool: Mapping[str, Any] | None = None,
    models: list[dict[str, Any]] | None = None,
    nodes: list[dict[str, Any]] | None = None,
    **sections: Any,
) -> str:
    """An edge config: loopback listeners on free ports, one echo node unless told otherwise."""
    doc: dict[str, Any] = {
        "edge": {"id": edge_id, "node_listen": ANY_PORT, "admin_listen": ANY_PORT, **(edge or {})},
        "openai": {"listen": ANY_PORT, **(openai or {})},
    }
    if provider_pool is not None:
        doc["provider_pool"] = dict(provider_pool)
    doc["models"] = models if models is not None else [model()]
    doc["nodes"] = nodes if nodes is not None else [node()]
    doc.update(sections)
    return yaml.safe_dump(doc, sort_keys=False)


def served_edge_yaml(
    base_url: str, *, edge_id: str, provider: Mapping[str, Any] | None = None, **sections: Any
) -> str:
    """An edge whose model ``m`` is one OpenAI-compatible provider ``vllm-a`` serving ``served``
    at ``base_url``, probed every 50 ms; ``provider`` overrides its fields."""
    spec = {
        "id": "vllm-a",
        "type": "openai",
        "base_url": base_url,
        "models": ["served"],
        "health_interval": 0.05,
        **(provider or {}),
    }
    return edge_yaml(
        edge_id=edge_id,
        models=[model("m", {"vllm-a": "served"})],
        nodes=[node(providers=[spec])],
        **sections,
    )


def echo_yaml(
    *,
    delay_ms: int = 0,
    capacity: int = 4,
    auth: str = "",
    extra_models: str = "",
    extra_providers: str = "",
    openai_extra: str = "",
    pool: str = "",
) -> str:
    return f"""
edge:
  id: edge-test
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  heartbeat_interval: 1
  heartbeat_timeout: 3
openai:
  listen: 127.0.0.1:0
{auth}{openai_extra}
{pool}
models:
  - id: echo
    providers: {{echo-1: echo}}
{extra_models}
nodes:
  - id: node-a
    alias: box-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
      - id: echo-1
        type: echo
        category: api
        models: [echo]
        capacity: {capacity}
        delay_ms: {delay_ms}
{extra_providers}
"""


def cli_provider(pid: str, script: str, *, models: str = "[cli]", extra: str = "") -> str:
    """One ``cli`` provider entry (indented for ``nodes[].providers``)."""
    return f"""      - id: {pid}
        type: cli
        category: cli
        models: {models}
        command: {py_command(script)}
        capacity: 4
        read_timeout: 20
{extra}"""


def http_provider(
    pid: str, ptype: str, base_url: str, *, models: str, capacity: int = 4, extra: str = ""
) -> str:
    return f"""      - id: {pid}
        type: {ptype}
        base_url: {base_url}
        models: {models}
        capacity: {capacity}
        health_interval: 30
{extra}"""


def node_entry(node_id: str, providers: str) -> str:
    return f"""  - id: {node_id}
    token_hash_sha256: {token_hash(node_token(node_id))}
    providers:
{providers}"""


def gateway_yaml(
    *, models: str, nodes: str, openai_extra: str = "", pool: str = "", edge_extra: str = ""
) -> str:
    return f"""
edge:
  id: edge-surface
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
{edge_extra}
openai:
  listen: 127.0.0.1:0
{openai_extra}
{pool}
models:
{models}
nodes:
{nodes}
"""


OLLAMA_SERVED = "mock:latest"


def ollama_yaml(base_url: str, *, generation: str = "") -> str:
    return f"""
edge:
  id: edge-ollama
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
models:
  - id: llama
    providers: {{ol-1: "{OLLAMA_SERVED}"}}
{generation}
  - id: echo-only
    providers: {{echo-1: echo}}
  - id: both
    providers: {{ol-1: "{OLLAMA_SERVED}", echo-1: echo}}
nodes:
  - id: node-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
      - id: ol-1
        type: ollama
        base_url: {base_url}
        models: ["{OLLAMA_SERVED}"]
        capacity: 4
        health_interval: 30
      - id: echo-1
        type: echo
        models: [echo]
        capacity: 4
"""
