"""The admin API's tests' configs and a raw admin request: two nodes, an admin token."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from tests.support.gateway import node_token, token_hash


def two_node_yaml(admin_listen: str = "127.0.0.1:0") -> str:
    return f"""
edge:
  id: edge-admin
  node_listen: 127.0.0.1:0
  admin_listen: {admin_listen}
  heartbeat_interval: 1
  heartbeat_timeout: 3
openai:
  listen: 127.0.0.1:0
provider_pool: {{max_queue: 7, queue_timeout: 5}}
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
        capacity: 3
        lifecycle_capabilities: [streaming]
      - id: echo-off
        type: echo
        category: api
        models: [echo]
        enabled: false
  - id: node-b
    token_hash_sha256: {token_hash(node_token("node-b"))}
    providers:
      - id: echo-2
        type: echo
        category: local_inference
        models: [echo]
        capacity: 2
        long_context_capacity: 1
"""


ADMIN_TOKEN = "iop_admin-canary-5f3a9c1e7b"


async def raw_admin(
    addr: tuple[str, int], head: str, *, body: bytes = b""
) -> tuple[int, dict[str, object] | None]:
    """Send ``head`` (request line and headers, no blank line) as is; (status, JSON body)."""
    stream = await trio.open_tcp_stream(*addr)
    async with stream:
        await stream.send_all(head.encode("latin-1") + b"\r\nconnection: close\r\n\r\n" + body)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(payload) if payload else None


def token_yaml(tmp_path: Path, token: str | None) -> Path:
    text = two_node_yaml()
    if token is not None:
        text = text.replace(
            "  admin_listen: 127.0.0.1:0\n",
            f"  admin_listen: 127.0.0.1:0\n  admin_token_hash_sha256: {token_hash(token)}\n",
        )
    path = tmp_path / "edge.yaml"
    path.write_text(text)
    return path
