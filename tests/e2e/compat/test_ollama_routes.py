"""Ollama's routes through the official ``ollama`` client.

A real edge + node in front of ``MockOllamaServer``: ``list`` (``/api/tags``,
from the catalog, with the details the node's probe read from the provider), ``show``, ``embed`` and the legacy ``embeddings``
(relayed to the group's ollama provider, byte-exact), ``chat`` (relayed), ``ps`` (the edge's in-flight view),
``/api/version`` (the edge's own), and errors in Ollama's shape
``{"error": "..."}`` that the client turns into a ``ResponseError`` with the
message, whoever refused: the route, the authentication, the model lookup or
the HTTP layer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import ollama
import pytest
import trio

from iopd import __version__
from tests.support.configs import OLLAMA_SERVED, ollama_yaml
from tests.support.gateway import (
    Gateway,
    http_request,
    in_thread,
    metric,
    running_gateway,
    wait_until,
)
from tests.support.mock_providers import LLAMA_TAG_DETAILS, MockOllamaServer

TOKEN = "sk-ollama-caller"


@asynccontextmanager
async def gateway(
    *, auth: bool = False, max_body: int | None = None, mock: MockOllamaServer | None = None
) -> AsyncIterator[tuple[Gateway, MockOllamaServer]]:
    mock = mock or MockOllamaServer()
    yaml_text = ollama_yaml("MOCK")
    extra = []
    if auth:
        extra.append(f"  bearer_token: {TOKEN}")
    if max_body is not None:
        extra.append(f"  max_body_bytes: {max_body}")
    if extra:
        yaml_text = yaml_text.replace(
            "  listen: 127.0.0.1:0\n", "  listen: 127.0.0.1:0\n" + "\n".join(extra) + "\n", 1
        )
    async with trio.open_nursery() as n:
        await n.start(mock.serve)
        async with running_gateway(yaml_text.replace("MOCK", mock.base_url)) as gw:
            yield gw, mock
        n.cancel_scope.cancel()


def client(gw: Gateway, **kwargs: object) -> ollama.Client:
    host, port = gw.host_port
    return ollama.Client(host=f"http://{host}:{port}", timeout=30, **kwargs)  # type: ignore[arg-type]


async def test_list_show_chat_embed_through_the_ollama_client() -> None:
    with trio.fail_after(30):
        async with gateway() as (gw, mock):
            c = client(gw)
            listed = await in_thread(c.list)
            assert [m.model for m in listed.models] == ["llama", "both"]

            shown = await in_thread(lambda: c.show("llama"))
            assert shown.modelfile == f"FROM {OLLAMA_SERVED}"  # the provider's answer, relayed
            assert shown.capabilities == ["completion"]
            sent = [r.json() for r in mock.requests if r.path == "/api/show"]
            assert sent == [{"model": OLLAMA_SERVED}]

            reply = await in_thread(
                lambda: c.chat(model="llama", messages=[{"role": "user", "content": "hi"}])
            )
            assert reply.message.content == mock.reply_text

            embedded = await in_thread(lambda: c.embed(model="llama", input=["a", "bcd"]))
            assert [list(e) for e in embedded.embeddings] == [[0.5, 1.0], [0.5, 3.0]]
            sent = [r.json() for r in mock.requests if r.path == "/api/embed"]
            assert sent[-1]["model"] == OLLAMA_SERVED and sent[-1]["input"] == ["a", "bcd"]
            # Relayed byte for byte: the same body straight from the mock.
            body = {"model": "llama", "input": "x"}
            r = await http_request(gw.host_port, "POST", "/api/embed", body=body)
            direct = await http_request(
                ("127.0.0.1", mock.port),
                "POST",
                "/api/embed",
                body={**body, "model": OLLAMA_SERVED},
            )
            assert r.status == 200 and r.body == direct.body

            # The legacy route (the client's ``embeddings``), relayed the same way.
            legacy = await in_thread(lambda: c.embeddings(model="llama", prompt="abcd"))
            assert list(legacy.embedding) == [0.5, 4.0]
            sent = [r.json() for r in mock.requests if r.path == "/api/embeddings"]
            assert len(sent) == 1
            assert sent[0]["model"] == OLLAMA_SERVED and sent[0]["prompt"] == "abcd"


async def test_list_shows_the_providers_details_under_the_groups_names() -> None:
    mock = MockOllamaServer()
    mock.listed = [OLLAMA_SERVED, "other:7b"]
    mock.tag_entries[OLLAMA_SERVED] = {"modified_at": "2026-11-30T10:00:00Z", **LLAMA_TAG_DETAILS}
    with trio.fail_after(30):
        async with gateway(mock=mock) as (gw, _mock):
            health = gw.runtime.health
            await wait_until(lambda: "ol-1" in health and bool(health["ol-1"].models))
            listed = await in_thread(client(gw).list)
    assert [m.model for m in listed.models] == ["llama", "both"]
    for m in listed.models:
        assert m.size == 4661224676 and m.digest == "365c0bd3c000"
        assert (
            m.modified_at is not None and m.modified_at.isoformat() == "2026-11-30T10:00:00+00:00"
        )
        assert m.details is not None
        assert (m.details.format, m.details.family, m.details.families) == (
            "gguf",
            "llama",
            ["llama"],
        )
        assert (m.details.parameter_size, m.details.quantization_level) == ("8.0B", "Q4_0")


async def test_ps_shows_groups_with_a_request_in_flight_and_version_is_the_edges() -> None:
    with trio.fail_after(30):
        async with gateway() as (gw, mock):
            c = client(gw)
            assert (await in_thread(c.ps)).models == []
            mock.chunk_delay = 0.2  # a slow stream keeps the provider busy meanwhile
            async with trio.open_nursery() as n:
                body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
                n.start_soon(lambda: http_request(gw.host_port, "POST", "/api/chat", body=body))
                loads = gw.runtime.pool.provider_loads
                await wait_until(lambda: loads()["ol-1"].in_flight == 1)
                running = await in_thread(c.ps)
                assert [m.model for m in running.models] == ["llama", "both"]
            r = await http_request(gw.host_port, "GET", "/api/version")
            assert r.status == 200 and r.json() == {"version": __version__}
            assert not [q for q in mock.requests if q.path in ("/api/ps", "/api/version")]


async def test_errors_on_api_routes_take_ollamas_shape() -> None:
    with trio.fail_after(30):
        async with gateway() as (gw, _mock):
            c = client(gw)
            # An unknown model: 404, the message names the models.
            with pytest.raises(ollama.ResponseError) as err:
                await in_thread(lambda: c.chat(model="nope", messages=[]))
            assert err.value.status_code == 404
            assert isinstance(err.value.error, str)
            assert "'nope' does not exist" in err.value.error and "llama" in err.value.error
            # A group without an ollama provider: 400 naming the route.
            with pytest.raises(ollama.ResponseError) as err:
                await in_thread(lambda: c.show("echo-only"))
            assert err.value.status_code == 400 and "/api/show" in err.value.error
            # Raw: the body is exactly {"error": "..."}; an unknown route and a
            # wrong method are refused from the head, in the same shape.
            for method, path, status in (
                ("POST", "/api/pull", 404),
                ("GET", "/api/chat", 405),
                ("POST", "/api/chat", 400),  # no body: not JSON
            ):
                r = await http_request(
                    gw.host_port, method, path, body=b"" if method == "POST" else None
                )
                assert r.status == status, (path, r.body)
                doc = json.loads(r.body)
                assert list(doc) == ["error"] and isinstance(doc["error"], str)
                assert r.header("x-request-id")
            # The OpenAI routes keep the OpenAI envelope.
            r = await http_request(gw.host_port, "GET", "/v1/chat/completions")
            assert r.status == 405 and r.json()["error"]["code"] == "method_not_allowed"


async def test_authentication_and_http_layer_refusals_take_ollamas_shape_too() -> None:
    with trio.fail_after(30):
        async with gateway(auth=True, max_body=1024) as (gw, _mock):
            with pytest.raises(ollama.ResponseError) as err:
                await in_thread(lambda: client(gw).list())
            assert err.value.status_code == 401 and isinstance(err.value.error, str)
            authed = client(gw, headers={"authorization": f"Bearer {TOKEN}"})
            assert [m.model for m in (await in_thread(authed.list)).models] == ["llama", "both"]
            # Over max_body_bytes: the HTTP layer refuses an admitted request.
            big = {"model": "llama", "prompt": "x" * 2000}
            r = await http_request(
                gw.host_port,
                "POST",
                "/api/generate",
                body=big,
                headers=[("authorization", f"Bearer {TOKEN}")],
            )
            assert r.status == 413 and isinstance(r.json()["error"], str)
            r = await http_request(
                gw.host_port,
                "POST",
                "/v1/chat/completions",
                body=big,
                headers=[("authorization", f"Bearer {TOKEN}")],
            )
            assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"


async def test_openai_embeddings_on_an_ollama_provider_go_through_api_embed() -> None:
    """``/v1/embeddings`` in a group whose only embedding provider is ollama:
    the node translates to ``/api/embed`` and back (the SDK asks for base64)."""
    with trio.fail_after(30):
        async with gateway() as (gw, mock):
            sdk = gw.sdk()
            got = await in_thread(lambda: sdk.embeddings.create(model="llama", input=["a", "bcd"]))
            assert [d.embedding for d in got.data] == [[0.5, 1.0], [0.5, 3.0]]
            assert [d.index for d in got.data] == [0, 1]
            assert got.usage.prompt_tokens == mock.prompt_eval_count
            sent = [r.json() for r in mock.requests if r.path == "/api/embed"]
            assert sent[-1] == {"model": OLLAMA_SERVED, "input": ["a", "bcd"]}

            body = {"model": "both", "input": "xy", "encoding_format": "float", "dimensions": 2}
            r = await http_request(gw.host_port, "POST", "/v1/embeddings", body=body)
            assert r.status == 200, r.body
            doc = json.loads(r.body)
            assert doc["object"] == "list" and doc["data"][0]["embedding"] == [0.5, 2.0]
            assert mock.requests[-1].json()["dimensions"] == 2
            tokens = metric(gw, "iop_openai_usage_tokens_total", endpoint="embeddings")
            assert tokens == 2 * mock.prompt_eval_count

            # What Ollama cannot embed is a clear 400, not a provider error.
            bad = {"model": "llama", "input": [[1, 2, 3]]}
            r = await http_request(gw.host_port, "POST", "/v1/embeddings", body=bad)
            assert r.status == 400 and "token arrays" in json.loads(r.body)["error"]["message"]
            # A group without ollama or passthrough providers still says who serves it.
            r = await http_request(
                gw.host_port, "POST", "/v1/embeddings", body={"model": "echo-only", "input": "x"}
            )
            assert r.status == 400 and "'ollama' ones" in json.loads(r.body)["error"]["message"]
