"""A provider ``base_url`` written the way client libraries want it.

The OpenAI SDK and LiteLLM take ``http://host:8000/v1``; iopd used to append
``/v1/...`` to that and probe ``/v1/v1/models``.  Unit tests pin the rules of
``iopd.config.provider_url``; the end-to-end tests run a mock OpenAI server
(and a mock Ollama) behind a real edge + node with each accepted form and
call it with the official ``openai`` SDK.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from iopd.cli import main
from iopd.config.catalog import node_config_for
from iopd.config.load import ConfigError, parse_edge_config
from iopd.config.provider_url import base_url_problem, provider_root, request_url
from tests.support.gateway import http_request, in_thread, node_token, running_gateway, token_hash
from tests.support.mock_providers import MockOllamaServer, MockOpenAIServer

# ------------------------------------------------------------------ the rules


@pytest.mark.parametrize(
    ("ptype", "given", "root"),
    [
        ("openai", "http://h:8000", "http://h:8000"),
        ("openai", "http://h:8000/", "http://h:8000"),
        ("openai", "http://h:8000/v1", "http://h:8000"),
        ("openai", "http://h:8000/v1/", "http://h:8000"),
        ("openai", "https://api.example.com/openai/v1", "https://api.example.com/openai"),
        ("openai", "https://api.example.com/openai/", "https://api.example.com/openai"),
        ("openai", "http://h:8000/v1beta", "http://h:8000/v1beta"),
        ("openai", "http://h:8000/v1/v1", "http://h:8000/v1"),  # one prefix is removed, once
        ("openai", "http://[::1]:8000/v1", "http://[::1]:8000"),
        ("openai", "http://user:pw@h:8000/v1", "http://user:pw@h:8000"),
        ("ollama", "http://h:11434", "http://h:11434"),
        ("ollama", "http://h:11434/api", "http://h:11434"),
        ("ollama", "http://h:11434/api/", "http://h:11434"),
        ("ollama", "http://h/ollama/api", "http://h/ollama"),
        ("cli", "http://h/v1", "http://h/v1"),  # not an HTTP provider: untouched
    ],
)
def test_provider_root(ptype: str, given: str, root: str) -> None:
    assert base_url_problem(ptype, given) is None
    assert provider_root(ptype, given) == root


@pytest.mark.parametrize(
    ("ptype", "given", "reason"),
    [
        ("openai", "ftp://h/", "must be an http:// or https:// URL with a host"),
        ("openai", "http://", "must be an http:// or https:// URL with a host"),
        ("openai", "http://h:99999", "must be an http:// or https:// URL with a host"),
        ("openai", "http://h/v1?api-version=1", "must not have a query string or fragment"),
        ("openai", "http://h/v1?", "must not have a query string or fragment"),
        ("openai", "http://h/v1#x", "must not have a query string or fragment"),
        ("openai", "http://h/v1/chat/completions", "ends in the endpoint /chat/completions"),
        ("openai", "http://h/v1/responses/", "ends in the endpoint /responses"),
        ("openai", "http://h/v1/models", "ends in the endpoint /models"),
        ("ollama", "http://h:11434/api/chat", "ends in the endpoint /api/chat"),
        ("ollama", "http://h:11434/v1", "use type 'openai'"),
    ],
)
def test_refused_base_urls(ptype: str, given: str, reason: str) -> None:
    problem = base_url_problem(ptype, given)
    assert problem is not None and reason in problem


def test_request_url_shows_the_chat_endpoint_without_userinfo() -> None:
    assert request_url("openai", "http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert request_url("openai", "https://k:secret@h/x/v1") == "https://h/x/v1/chat/completions"
    assert request_url("ollama", "http://h:11434/api") == "http://h:11434/api/chat"


# ------------------------------------------------------------------ config layer

EDGE_YAML = """
edge:
  id: edge-compat
  node_listen: 127.0.0.1:0
  admin_listen: 127.0.0.1:0
openai:
  listen: 127.0.0.1:0
models:
  - id: m
    providers: {{p-1: served}}
nodes:
  - id: node-a
    token_hash_sha256: {hash}
    providers:
      - id: p-1
        type: {ptype}
        base_url: {base}
        models: [served]
        health_interval: 0.05
"""


def _yaml(base: str, ptype: str = "openai") -> str:
    return EDGE_YAML.format(hash=token_hash(node_token("node-a")), base=base, ptype=ptype)


def test_the_node_is_sent_the_root() -> None:
    cfg = parse_edge_config(_yaml("http://127.0.0.1:8000/v1/"), env={})
    (spec,) = node_config_for(cfg, "node-a", version=1).providers
    assert spec.base_url == "http://127.0.0.1:8000"
    assert cfg.nodes[0].providers[0].base_url == "http://127.0.0.1:8000/v1/"  # config as written


def test_a_query_string_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_edge_config(_yaml("http://127.0.0.1:8000/v1?api-version=2"), env={})
    assert any(
        e.startswith("nodes[0].providers[0].base_url: must not have a query string")
        for e in info.value.errors
    ), info.value.errors


def test_config_check_prints_where_requests_go(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(_yaml("http://key:hunter2@127.0.0.1:8000/v1"))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "provider p-1 (openai): requests go to http://127.0.0.1:8000/v1/chat/completions\n" in out
    assert "hunter2" not in out and "key@" not in out


# ------------------------------------------------------------------ end to end


async def _health(gw) -> str:  # type: ignore[no-untyped-def]
    doc = (await http_request(gw.handle.admin, "GET", "/status")).json()
    return str(doc["providers"][0]["health"])


async def _wait_healthy(gw) -> None:  # type: ignore[no-untyped-def]
    while (health := await _health(gw)) != "healthy":
        assert health != "unhealthy", "the probe hit a wrong path"
        await trio.sleep(0.02)


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
async def test_openai_sdk_through_a_provider_configured_with(suffix: str) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOpenAIServer()
            await n.start(mock.serve)
            async with running_gateway(_yaml(mock.base_url + suffix)) as gw:
                await _wait_healthy(gw)
                client = gw.sdk()
                msgs = [{"role": "user", "content": "hello there"}]
                resp = await in_thread(
                    lambda: client.chat.completions.create(model="m", messages=msgs)
                )
                assert resp.choices[0].message.content
                stream = await in_thread(
                    lambda: list(
                        client.chat.completions.create(model="m", messages=msgs, stream=True)
                    )
                )
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            paths = {(r.method, r.path) for r in mock.requests}
            assert paths == {("GET", "/v1/models"), ("POST", "/v1/chat/completions")}, paths
            n.cancel_scope.cancel()


@pytest.mark.parametrize("suffix", ["", "/api", "/api/"])
async def test_ollama_provider_configured_with(suffix: str) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            mock = MockOllamaServer()
            await n.start(mock.serve)
            async with running_gateway(_yaml(mock.base_url + suffix, "ollama")) as gw:
                await _wait_healthy(gw)
                client = gw.sdk()
                msgs = [{"role": "user", "content": "hello there"}]
                resp = await in_thread(
                    lambda: client.chat.completions.create(model="m", messages=msgs)
                )
                assert resp.choices[0].message.content
            paths = {(r.method, r.path) for r in mock.requests}
            assert paths == {("GET", "/api/tags"), ("POST", "/api/chat")}, paths
            n.cancel_scope.cancel()
