"""The admin API's tests' configs and a raw admin request: two nodes, an admin token."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from tests.support import configs
from tests.support.configs import ANY_PORT, echo_entry
from tests.support.gateway import token_hash


def two_node_yaml(admin_listen: str = ANY_PORT) -> str:
    """node-a: echo-1 (capacity 3, streaming) and echo-off (disabled); node-b: echo-2."""
    return configs.two_node_yaml(
        edge_id="edge-admin",
        admin_listen=admin_listen,
        max_queue=7,
        queue_timeout=5,
        node_a=echo_entry(capacity=3, lifecycle_capabilities=["streaming"])
        + echo_entry("echo-off", capacity=None, enabled=False),
        node_b=echo_entry(
            "echo-2", category="local_inference", capacity=2, long_context_capacity=1
        ),
    )


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
