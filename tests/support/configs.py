"""The one builder of edge configs for in-process tests: YAML text from a few parts.

Most tests run one edge with one echo node (``node-a``, provider ``echo-1``
serving model ``echo``) and change only what they pin: a capacity, a timeout,
a principal token.  ``edge_yaml`` gives that config with every section
overridable; ``echo_provider``, ``node`` and ``model`` build the parts.  The
result is plain YAML (``yaml.safe_dump``), as an operator would write it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import yaml

from tests.support.gateway import node_token, token_hash

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


def served_edge_yaml(base_url: str, *, edge_id: str, **sections: Any) -> str:
    """An edge whose model ``m`` is one OpenAI-compatible provider ``vllm-a`` serving ``served``
    at ``base_url``, probed every 50 ms."""
    provider = {
        "id": "vllm-a",
        "type": "openai",
        "base_url": base_url,
        "models": ["served"],
        "health_interval": 0.05,
    }
    return edge_yaml(
        edge_id=edge_id,
        models=[model("m", {"vllm-a": "served"})],
        nodes=[node(providers=[provider])],
        **sections,
    )
