"""The config the refresh classification tests start from, and how they diff two texts."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from typing import Any

import yaml

from iopd.config.load import parse_edge_config
from iopd.config.refresh_classify import RefreshDiff, classify
from iopd.config.schema import EdgeConfig

H = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(6)]


Mutation = Callable[[dict[str, Any]], object]


BASE: dict[str, Any] = {
    "edge": {"id": "e1", "node_listen": "127.0.0.1:7070", "admin_listen": "127.0.0.1:7071"},
    "openai": {
        "principal_tokens": [
            {"token_ref": "app-1", "token_hash_sha256": H[0], "principal_ref": "u1"}
        ],
        "model_routes": [{"model": "r1", "node": "node-a", "adapter": "vllm-a", "target": "m-a"}],
    },
    "models": [
        {"id": "g1", "providers": {"vllm-a": "m-a", "echo-b": "echo"}},
        {"id": "g2", "providers": {"vllm-b": "m-b"}},
    ],
    "nodes": [
        {
            "id": "node-a",
            "token_hash_sha256": H[1],
            "providers": [
                {
                    "id": "vllm-a",
                    "type": "openai",
                    "base_url": "http://h:1",
                    "models": ["m-a"],
                    "capacity": 4,
                },
                {"id": "vllm-b", "type": "openai", "base_url": "http://h:2", "models": ["m-b"]},
            ],
        },
        {
            "id": "node-b",
            "token_hash_sha256": H[2],
            "providers": [{"id": "echo-b", "type": "echo", "models": ["echo"]}],
        },
    ],
}


def load(data: dict[str, Any]) -> EdgeConfig:
    return parse_edge_config(yaml.safe_dump(data), env={})


def diff_of(mutate: Mutation) -> RefreshDiff:
    new = copy.deepcopy(BASE)
    mutate(new)
    return classify(load(BASE), load(new))
