"""Endpoints real clients call besides chat.

A real edge + node in front of ``MockOpenAIServer``, called with the official
``openai`` SDK the way users found the gaps:

* ``client.models.retrieve`` answers like OpenAI, and an unknown model's 404
  names the models the caller may send (bounded);
* ``/v1/embeddings`` and ``/v1/completions`` are relayed byte-exact to a
  passthrough provider, metered with their own ``endpoint`` label, and a
  group without a passthrough provider gets a 400 naming the endpoint;
* ``iopd status`` shows the model groups with their providers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import openai
import pytest
import trio

from iopd.admin_client import format_status
from tests.support.configs import echo_entry, gateway_yaml, http_provider, node_entry
from tests.support.gateway import (
    Gateway,
    http_request,
    in_thread,
    running_gateway,
)
from tests.support.metrics import changes, scrape
from tests.support.mock_providers import MockOpenAIServer

SERVED = "mock-model"


def routes_yaml(base_url: str, extra_models: str = "") -> str:
    return gateway_yaml(
        edge_id="edge-routes",
        models=(
            f"  - id: gpt-local\n    providers: {{oa-1: {SERVED}}}\n"
            f"  - id: org/with-slash\n    providers: {{oa-1: {SERVED}}}\n"
            "  - id: echo-only\n    providers: {echo-1: echo}\n" + extra_models
        ),
        nodes=node_entry(
            "node-a",
            http_provider("oa-1", "openai", base_url, models=f"[{SERVED}]")
            + echo_entry(category=None),
        ),
    )


@asynccontextmanager
async def openai_gateway(extra_models: str = "") -> AsyncIterator[tuple[Gateway, MockOpenAIServer]]:
    mock = MockOpenAIServer()
    async with trio.open_nursery() as n:
        await n.start(mock.serve)
        async with running_gateway(routes_yaml(mock.base_url, extra_models)) as gw:
            yield gw, mock
        n.cancel_scope.cancel()


# ------------------------------------------------------------------ models


async def test_models_retrieve_answers_like_openai() -> None:
    with trio.fail_after(30):
        async with openai_gateway() as (gw, _mock):
            client = gw.sdk()
            model = await in_thread(lambda: client.models.retrieve("gpt-local"))
            assert (model.id, model.object, model.owned_by) == ("gpt-local", "model", "iopd")
            assert isinstance(model.created, int)
            # An id with a slash: the SDK sends it as is or percent-encoded.
            for path in ("/v1/models/org/with-slash", "/v1/models/org%2Fwith-slash"):
                r = await http_request(gw.host_port, "GET", path)
                assert r.status == 200 and r.json()["id"] == "org/with-slash"

            with pytest.raises(openai.NotFoundError) as err:
                await in_thread(lambda: client.models.retrieve("nope"))
            body = err.value.body
            assert isinstance(body, dict) and body["code"] == "model_not_found"
            assert "'nope' does not exist" in body["message"]
            assert "gpt-local, org/with-slash, echo-only" in body["message"]


async def test_unknown_model_404_lists_at_most_20_ids() -> None:
    many = "\n".join(f"  - id: m{i:02d}\n    providers: {{echo-1: echo}}" for i in range(25))
    with trio.fail_after(30):
        async with openai_gateway(many) as (gw, _mock):
            client = gw.sdk()
            with pytest.raises(openai.NotFoundError) as err:
                await in_thread(
                    lambda: client.chat.completions.create(
                        model="nope", messages=[{"role": "user", "content": "hi"}]
                    )
                )
            body = err.value.body
            assert isinstance(body, dict) and body["code"] == "model_not_found"
            message = body["message"]
            # 28 groups: the first 20 named, then how many more and where to look.
            assert "gpt-local, org/with-slash, echo-only, m00," in message
            assert "m16" in message and "m17" not in message
            assert "and 8 more (GET /v1/models lists them)" in message


async def test_status_shows_model_groups_with_their_providers() -> None:
    with trio.fail_after(30):
        async with openai_gateway() as (gw, _mock):
            r = await http_request(gw.handle.admin, "GET", "/status")
            doc = r.json()
            groups = {m["id"]: m for m in doc["models"]}
            assert groups["gpt-local"]["providers"] == [
                {"provider": "oa-1", "served": SERVED, "type": "openai"}
            ]
            assert groups["echo-only"]["source"] == "models"
            text = format_status(doc)
            assert "MODEL" in text
            line = next(ln for ln in text.splitlines() if ln.startswith("gpt-local"))
            assert f"oa-1={SERVED}" in line


# ------------------------------------------------------------------ more endpoints


def _relayed_posts(mock: MockOpenAIServer, path: str) -> list[dict[str, object]]:
    return [r.json() for r in mock.requests if r.method == "POST" and r.path == path]


async def test_embeddings_relayed_byte_exact_and_metered() -> None:
    with trio.fail_after(30):
        async with openai_gateway() as (gw, mock):
            client = gw.sdk()
            before = await scrape(gw)
            result = await in_thread(
                lambda: client.embeddings.create(
                    model="gpt-local", input=["one", "three"], encoding_format="float"
                )
            )
            assert [d.embedding for d in result.data] == [[0.5, -0.25, 3.0], [0.5, -0.25, 5.0]]
            assert result.usage.prompt_tokens == 11
            sent = _relayed_posts(mock, "/v1/embeddings")[-1]
            assert sent == {"model": SERVED, "input": ["one", "three"], "encoding_format": "float"}
            # The provider's bytes, unchanged.
            raw = {"model": "gpt-local", "input": "x"}
            r = await http_request(gw.host_port, "POST", "/v1/embeddings", body=raw)
            direct = await http_request(
                ("127.0.0.1", mock.port), "POST", "/v1/embeddings", body={**raw, "model": SERVED}
            )
            assert r.status == 200 and r.body == direct.body
            after = await scrape(gw)
            assert after.get(
                "iop_openai_requests_total", endpoint="embeddings", status="ok"
            ) - before.get("iop_openai_requests_total", endpoint="embeddings", status="ok") == 2
            tokens = changes(before, after, "iop_openai_usage_tokens_total")
            assert sum(v for ls, v in tokens.items() if ("token_type", "input") in ls) == 22
            assert all(("endpoint", "embeddings") in ls for ls in tokens)


async def test_completions_relayed_streamed_and_not() -> None:
    with trio.fail_after(30):
        async with openai_gateway() as (gw, mock):
            client = gw.sdk()
            before = await scrape(gw)
            done = await in_thread(
                lambda: client.completions.create(model="gpt-local", prompt="Say hi", max_tokens=5)
            )
            assert done.choices[0].text == mock.reply_text
            assert done.usage is not None and done.usage.completion_tokens == 7

            def streamed() -> str:
                stream = client.completions.create(
                    model="gpt-local", prompt="Say hi", stream=True, echo=False
                )
                return "".join(c.choices[0].text for c in stream if c.choices)

            assert await in_thread(streamed) == mock.reply_text
            sent = _relayed_posts(mock, "/v1/completions")
            assert sent[0] == {"model": SERVED, "prompt": "Say hi", "max_tokens": 5}
            assert sent[1]["echo"] is False  # unknown-to-the-edge fields travel unchanged
            after = await scrape(gw)
            assert after.get(
                "iop_openai_requests_total", endpoint="completions", response_mode="passthrough"
            ) - before.get("iop_openai_requests_total", endpoint="completions") == 2


async def test_endpoint_without_a_passthrough_provider_is_a_400_naming_it() -> None:
    with trio.fail_after(30):
        async with openai_gateway() as (gw, _mock):
            client = gw.sdk()
            with pytest.raises(openai.BadRequestError) as err:
                await in_thread(lambda: client.embeddings.create(model="echo-only", input="x"))
            body = err.value.body
            assert isinstance(body, dict) and body["param"] == "model"
            assert "/v1/embeddings" in body["message"]
            with pytest.raises(openai.BadRequestError) as err:
                await in_thread(lambda: client.completions.create(model="echo-only", prompt="x"))
            assert "/v1/completions" in str(err.value)
            # model is required; the rest is the provider's to judge.
            r = await http_request(gw.host_port, "POST", "/v1/embeddings", body={"input": "x"})
            assert r.status == 400 and r.json()["error"]["param"] == "model"
            r = await http_request(
                gw.host_port, "GET", "/v1/embeddings", headers=[("accept", "application/json")]
            )
            assert r.status == 405
            assert json.loads(r.body)["error"]["code"] == "method_not_allowed"
