"""A request path without a listener: an ``EdgeRuntime`` of a few kinds of
groups and a ``Request`` as the HTTP layer hands it over, for the unit tests
of ``prepare``, ``needs`` and ``relay``."""

from __future__ import annotations

from typing import Any

from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.http.connection import Request
from tests.support.configs import echo_provider, edge_yaml, model, node
from tests.support.gateway import edge_config

PASSTHROUGH = {
    "id": "vllm-a",
    "type": "openai",
    "base_url": "http://127.0.0.1:9/v1",
    "models": ["served"],
}
OLLAMA = {"id": "ol-1", "type": "ollama", "base_url": "http://127.0.0.1:9", "models": ["llama"]}


def runtime(**openai: Any) -> EdgeRuntime:
    """Groups ``echo`` (normalized), ``pt`` (passthrough only, max_tokens ≤ 100),
    ``mixed`` (both) and ``ol`` (ollama)."""
    limited = {**model("pt", {"vllm-a": "served"}), "generation": {"limits": {"max_tokens": 100}}}
    yaml_text = edge_yaml(
        openai=openai,
        models=[
            model("echo"),
            limited,
            model("mixed", {"echo-1": "echo", "vllm-a": "served"}),
            model("ol", {"ol-1": "llama"}),
        ],
        nodes=[node(providers=[echo_provider(), PASSTHROUGH, OLLAMA])],
    )
    return EdgeRuntime.create(edge_config(yaml_text))


def post_request(
    body: bytes, path: str = "/v1/chat/completions", headers: list[tuple[str, str]] | None = None
) -> Request:
    return Request("POST", path, path, "", headers or [], body, None, "1.1")
