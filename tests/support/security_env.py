"""A gateway for the hostile tests of secrets and reach: an edge and node-a in this process
with canary secrets everywhere (caller bearer, principal token, provider-auth value, a
provider ``api_key``, the node token), an OpenAI-compatible mock ``oa`` (model ``pt``), an
Ollama mock ``ol`` (model ``ol``, holding ``API_KEY``), an echo model and a ``decoy`` server no
request may ever reach; ``Env.call`` writes a request byte for byte and keeps what the edge
wrote."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import h11
import trio

from tests.support.gateway import (
    Gateway,
    RawResponse,
    node_token,
    read_response,
    running_gateway,
    token_hash,
)
from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer

CALLER = "sk-canary-principal-4c1f9e2a7b"
LEGACY = "sk-canary-legacy-8d2b6f0e3a"
WRONG_BEARER = "sk-canary-wrong-bearer-1a9c7e5d"
PROVIDER_AUTH = "pa-canary-forwarded-6e4c2a0b8f"
API_KEY = "ak-canary-provider-key-3b7d9f1c5e"
WRONG_NODE = "nt-canary-wrong-node-0f2e4d6c8a"
NODE = node_token("node-a")  # the real node token: a canary too

CANARIES = [CALLER, LEGACY, WRONG_BEARER, PROVIDER_AUTH, API_KEY, WRONG_NODE, NODE]

EDGE_YAML = """
edge:
  id: sec-edge
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
  bearer_token: {legacy}
  principal_tokens:
    - {{token_ref: sec-app, token_hash_sha256: {caller_hash}, principal_ref: sec-user, alias: sec}}
  provider_auth: {{header: X-Provider-Authorization, target_header: Authorization}}
provider_pool: {{max_queue: 8, queue_timeout: 5}}
models:
  - id: echo
    providers: {{echo-1: echo}}
  - id: pt
    providers: {{oa-1: mock-model}}
  - id: ol
    providers: {{ol-1: "mock:latest"}}
nodes:
  - id: node-a
    token_hash_sha256: {node_hash}
    providers:
      - id: echo-1
        type: echo
        models: [echo]
        capacity: 4
      - id: oa-1
        type: openai
        base_url: {oa_base}
        models: [mock-model]
        capacity: 4
        health_interval: 0.2
      - id: ol-1
        type: ollama
        base_url: {ol_base}
        api_key: {api_key}
        models: ["mock:latest"]
        capacity: 4
        health_interval: 0.2
"""


@dataclass
class Env:
    gw: Gateway
    oa: MockOpenAIServer
    ol: MockOllamaServer
    decoy: MockOpenAIServer
    nursery: trio.Nursery
    #: Every body (and header value) the edge itself wrote to a caller.
    edge_output: list[str] = field(default_factory=list)

    async def call(
        self,
        path: str,
        body: dict[str, object] | bytes | None = None,
        *,
        method: str = "POST",
        headers: list[tuple[str, str]] | None = None,
        token: str | None = CALLER,
        record: bool = True,
    ) -> RawResponse:
        hdrs = list(headers or [])
        if token is not None:
            hdrs.append(("authorization", f"Bearer {token}"))
        resp = await raw_request(self.gw.host_port, method, path, body=body, headers=hdrs)
        if record:
            self.edge_output.append(resp.body.decode("utf-8", "replace"))
            self.edge_output.extend(f"{k}: {v}" for k, v in resp.headers)
        return resp


async def raw_request(
    host_port: tuple[str, int],
    method: str,
    target: str,
    *,
    body: dict[str, object] | bytes | None = None,
    headers: list[tuple[str, str]] | None = None,
) -> RawResponse:
    """One request written byte for byte (any target, our own ``Host`` if given)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    hdrs = list(headers or [])
    if not any(k.lower() == "host" for k, _ in hdrs):
        hdrs.insert(0, ("host", f"{host_port[0]}:{host_port[1]}"))
    hdrs.append(("connection", "close"))
    if body is not None:
        hdrs += [("content-type", "application/json"), ("content-length", str(len(body)))]
    head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs)
    stream = await trio.open_tcp_stream(*host_port)
    async with stream:
        await stream.send_all(head.encode() + b"\r\n" + (body or b""))
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        return await read_response(stream, conn)


@asynccontextmanager
async def security_env() -> AsyncIterator[Env]:
    async with trio.open_nursery() as nursery:
        oa = await nursery.start(MockOpenAIServer().serve)
        ol = await nursery.start(MockOllamaServer().serve)
        decoy = await nursery.start(MockOpenAIServer().serve)
        yaml_text = EDGE_YAML.format(
            legacy=LEGACY,
            caller_hash=token_hash(CALLER),
            node_hash=token_hash(NODE),
            oa_base=oa.base_url,
            ol_base=ol.base_url,
            api_key=API_KEY,
        )
        async with running_gateway(yaml_text) as gw:
            yield Env(gw, oa, ol, decoy, nursery)
        nursery.cancel_scope.cancel()


def chat(model: str, text: str = "hello there", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}
