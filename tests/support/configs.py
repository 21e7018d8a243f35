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


#: A ``cli`` provider script (``.format(pid=...)``) that answers with the provider's id.
WHOAMI = "print('served-by-{pid}')"

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
    """One node ``node-a`` (alias ``box-a``) with echo provider ``echo-1``, heartbeats 1/3 s;
    the other arguments are YAML lines put in their sections as they are."""
    return gateway_yaml(
        edge_id="edge-test",
        edge_extra=HEARTBEAT,
        openai_extra=auth + openai_extra,
        pool=pool,
        models="  - id: echo\n    providers: {echo-1: echo}\n" + extra_models,
        nodes=node_entry(
            "node-a",
            echo_entry(capacity=capacity, delay_ms=delay_ms) + extra_providers,
            alias="box-a",
        ),
    )


#: The edge's heartbeat lines most tests use (1 s, 3 s).
HEARTBEAT = "  heartbeat_interval: 1\n  heartbeat_timeout: 3"


def _flow(value: object) -> str:
    """``value`` as a YAML flow value: booleans as ``true``/``false``, a list as ``[a, b]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def provider_entry(pid: str, ptype: str, **fields: object) -> str:
    """One ``nodes[].providers`` entry as YAML text, its fields in the order given."""
    lines = [f"      - id: {pid}", f"        type: {ptype}"]
    lines += [f"        {key}: {_flow(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def echo_entry(
    pid: str = "echo-1", *, category: str | None = "api", capacity: int | None = 4, **fields: object
) -> str:
    """An echo provider entry serving ``echo`` (``category`` or ``capacity`` None leaves the
    schema's default)."""
    head: dict[str, object] = {} if category is None else {"category": category}
    head["models"] = ["echo"]
    if capacity is not None:
        head["capacity"] = capacity
    return provider_entry(pid, "echo", **head, **fields)


#: The ``models`` section of ``two_node_yaml``: ``echo`` on ``echo-1`` and ``echo-2``.
TWO_ECHOES = "  - id: echo\n    providers: {echo-1: echo, echo-2: echo}\n"


def two_node_yaml(
    *,
    edge_id: str,
    node_a: str,
    node_b: str,
    max_queue: int,
    queue_timeout: float,
    alias_b: str | None = None,
    models: str = TWO_ECHOES,
    admin_listen: str = ANY_PORT,
    openai_listen: str = ANY_PORT,
    openai_extra: str = "",
    extra_nodes: str = "",
) -> str:
    """Two nodes: ``node-a`` (alias ``box-a``) with the provider entries ``node_a``, ``node-b``
    with ``node_b``; heartbeats 1/3 s; ``extra_nodes`` (``nodes[]`` entries) after them."""
    return gateway_yaml(
        edge_id=edge_id,
        admin_listen=admin_listen,
        edge_extra=HEARTBEAT,
        openai_listen=openai_listen,
        openai_extra=openai_extra,
        pool=f"provider_pool: {{max_queue: {max_queue}, queue_timeout: {queue_timeout}}}",
        models=models,
        nodes=node_entry("node-a", node_a, alias="box-a")
        + node_entry("node-b", node_b, alias=alias_b)
        + extra_nodes,
    )


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


def node_entry(
    node_id: str, providers: str, *, alias: str | None = None, verifier: str | None = None
) -> str:
    """One ``nodes[]`` entry holding ``providers``: its credential is ``verifier`` (a
    ``token_verifier``) if given, else the hash of ``node_token(node_id)``."""
    alias_line = f"    alias: {alias}\n" if alias else ""
    if verifier is None:
        credential = f"token_hash_sha256: {token_hash(node_token(node_id))}"
    else:
        credential = f'token_verifier: "{verifier}"'
    return f"""  - id: {node_id}
{alias_line}    {credential}
    providers:
{providers}"""


def gateway_yaml(
    *,
    models: str,
    nodes: str,
    openai_extra: str = "",
    pool: str = "",
    edge_extra: str = "",
    edge_id: str = "edge-surface",
    admin_listen: str = ANY_PORT,
    openai_listen: str = ANY_PORT,
) -> str:
    """An edge config from YAML text: every argument but the ids and listeners is lines put in
    its section as they are."""
    return f"""
edge:
  id: {edge_id}
  node_listen: 127.0.0.1:0
  admin_listen: {admin_listen}
{edge_extra}
openai:
  listen: {openai_listen}
{openai_extra}
{pool}
models:
{models}
nodes:
{nodes}
"""


OLLAMA_SERVED = "mock:latest"


def ollama_yaml(base_url: str, *, generation: str = "") -> str:
    """Models ``llama`` (Ollama provider ``ol-1`` at ``base_url``, then ``generation`` lines),
    ``echo-only`` and ``both`` on one node."""
    return gateway_yaml(
        edge_id="edge-ollama",
        models=(
            f'  - id: llama\n    providers: {{ol-1: "{OLLAMA_SERVED}"}}\n{generation}\n'
            "  - id: echo-only\n    providers: {echo-1: echo}\n"
            f'  - id: both\n    providers: {{ol-1: "{OLLAMA_SERVED}", echo-1: echo}}'
        ),
        nodes=node_entry(
            "node-a",
            http_provider("ol-1", "ollama", base_url, models=f'["{OLLAMA_SERVED}"]')
            + echo_entry(category=None),
        ),
    )


def ollama_only_yaml(base_url: str, model_id: str, *, group: str = "", extra: str = "") -> str:
    """Node ``node-a`` whose one provider is Ollama ``ol-1`` at ``base_url``, serving
    ``OLLAMA_SERVED`` as model ``model_id``; ``group``: more lines of that model (its
    generation policy), ``extra``: more lines of the provider."""
    return gateway_yaml(
        models=f"  - id: {model_id}\n    providers: {{ol-1: '{OLLAMA_SERVED}'}}\n{group}",
        nodes=node_entry(
            "node-a",
            http_provider("ol-1", "ollama", base_url, models=f"['{OLLAMA_SERVED}']", extra=extra),
        ),
    )


def one_slot_yaml(request_timeout: float = 5) -> str:
    """One echo provider with one slot (1 s a chunk); a request may wait (queue 8, 60 s) far
    longer than it may run (``request_timeout``); drain_timeout 30 s."""
    return edge_yaml(
        edge_id="edge-open",
        edge={"drain_timeout": 30},
        openai={"request_timeout": request_timeout},
        provider_pool={"max_queue": 8, "queue_timeout": 60},
        nodes=[node(providers=[echo_provider(capacity=1, delay_ms=1000)])],
    )


def passthrough_yaml(base_url: str = "http://127.0.0.1:9", *, openai_extra: str = "") -> str:
    """Model ``direct`` (``max_tokens`` at most 100) on one OpenAI-compatible provider
    ``vllm-a`` serving ``served-a`` at ``base_url``; no queue (``max_queue: 0``)."""
    provider = f'      - {{id: vllm-a, type: openai, base_url: "{base_url}", models: [served-a]}}\n'
    return gateway_yaml(
        edge_id="edge-pt",
        openai_extra=openai_extra,
        pool="provider_pool: {max_queue: 0}",
        models=(
            "  - id: direct\n    providers: {vllm-a: served-a}\n"
            "    generation: {limits: {max_tokens: 100}}\n"
        ),
        nodes=node_entry("node-a", provider),
    )


def remote_yaml(base_url: str, **sections: str) -> str:
    """Model ``remote`` on one OpenAI-compatible provider ``oa-1`` serving ``mock-model`` at
    ``base_url`` (a passthrough group); ``sections`` go to ``gateway_yaml`` as they are."""
    return gateway_yaml(
        models="  - id: remote\n    providers: {oa-1: mock-model}\n",
        nodes=node_entry(
            "node-a", http_provider("oa-1", "openai", base_url, models="[mock-model]")
        ),
        **sections,
    )
