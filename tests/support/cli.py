"""The CLI's tests: an edge started from a config file, iopd as a subprocess, a table row."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from tests.support.gateway import (
    Gateway,
    node_token,
    running_gateway,
    token_hash,
)


def edge_yaml(cap1: int = 2, remote_base: str = "http://127.0.0.1:9", delay_ms: int = 0) -> str:
    return f"""
edge:
  id: edge-cli
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
  heartbeat_interval: 1
  heartbeat_timeout: 3
openai:
  listen: 127.0.0.1:0
provider_pool: {{max_queue: 12, queue_timeout: 30}}
models:
  - id: echo
    providers: {{echo-1: echo, echo-2: echo}}
nodes:
  - id: node-a
    alias: box-a
    token_hash_sha256: {token_hash(node_token("node-a"))}
    providers:
      - id: echo-1
        type: echo
        category: api
        models: [echo]
        capacity: {cap1}
        delay_ms: {delay_ms}
      - id: remote-1
        type: openai
        category: api
        base_url: {remote_base}
        models: [remote-model]
        health_interval: 1
  - id: node-b
    token_hash_sha256: {token_hash(node_token("node-b"))}
    providers:
      - id: echo-2
        type: echo
        category: local_inference
        models: [echo]
        capacity: 4
        long_context_capacity: 1
"""


@asynccontextmanager
async def edge_from_file(tmp_path: Path, **kw: Any) -> AsyncIterator[tuple[Gateway, Path]]:
    """A gateway running from a config file, with node-a connected and node-b not."""
    path = tmp_path / "edge.yaml"
    path.write_text(edge_yaml(**kw))
    async with running_gateway(path.read_text(), nodes=["node-a"], config_path=str(path)) as gw:
        yield gw, path


async def iopd(
    *args: str, admin_token: str | None = None, admin_url: str | None = None
) -> tuple[int, str, str]:
    """Run ``python -m iopd ARGS`` (``IOP_ADMIN_TOKEN`` = ``admin_token`` and
    ``IOP_ADMIN_URL`` = ``admin_url``, each unset if None); return (exit code,
    stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("IOP_ADMIN_TOKEN", "IOP_ADMIN_URL")}
    if admin_token is not None:
        env["IOP_ADMIN_TOKEN"] = admin_token
    if admin_url is not None:
        env["IOP_ADMIN_URL"] = admin_url
    proc = await trio.run_process(
        [sys.executable, "-m", "iopd", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=env,
    )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def row_of(out: str, provider: str) -> list[str]:
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 1 and fields[1] == provider:
            return fields
    raise AssertionError(f"no table row for {provider}:\n{out}")
