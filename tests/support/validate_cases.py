"""A valid edge config (BASE) and the mutations the validation tests apply to it."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from typing import Any

import yaml

from iopd.config.load import ConfigError, parse_edge_config, parse_node_config

H1 = hashlib.sha256(b"node-a").hexdigest()


H2 = hashlib.sha256(b"node-b").hexdigest()


P1 = hashlib.sha256(b"app-1").hexdigest()


P2 = hashlib.sha256(b"app-2").hexdigest()


BASE: dict[str, Any] = {
    "edge": {"id": "e1", "node_listen": "127.0.0.1:7070", "admin_listen": "127.0.0.1:7071"},
    "openai": {
        "principal_tokens": [
            {"token_ref": "app-1", "token_hash_sha256": P1, "principal_ref": "user-1"},
            {"token_ref": "app-2", "token_hash_sha256": P2, "principal_ref": "user-1"},
        ]
    },
    "models": [{"id": "g1", "providers": {"vllm-a": "m-a", "echo-b": "echo"}}],
    "nodes": [
        {
            "id": "node-a",
            "token_hash_sha256": H1,
            "providers": [
                {
                    "id": "vllm-a",
                    "type": "openai",
                    "base_url": "http://127.0.0.1:8000",
                    "models": ["m-a"],
                    "capacity": 4,
                },
                {
                    "id": "cli-a",
                    "type": "cli",
                    "command": ["codex", "exec", "-"],
                    "models": ["codex"],
                },
            ],
        },
        {
            "id": "node-b",
            "token_hash_sha256": H2,
            "providers": [{"id": "echo-b", "type": "echo", "models": ["echo"]}],
        },
    ],
}


Mutation = Callable[[dict[str, Any]], None]


def errors_of(mutate: Mutation, base: dict[str, Any] = BASE) -> list[str]:
    data = copy.deepcopy(base)
    mutate(data)
    text = yaml.safe_dump(data)
    try:
        if "node" in data and "edge" not in data:
            parse_node_config(text, env={})
        else:
            parse_edge_config(text, env={})
    except ConfigError as exc:
        return exc.errors
    return []
