"""The normalized path to Ollama keeps ``response_format`` and images.

``response_format`` becomes Ollama's ``format`` (``json_object`` -> ``"json"``,
``json_schema`` -> the schema object) and image parts with a ``data:`` URL
become the message's ``images`` (base64); both were dropped silently.  A
remote image URL, a non-base64 data URL or a part Ollama cannot take is a
400 ``bad_request`` before anything reaches the provider.

End to end: the official ``openai`` SDK, a real edge and node, and
``MockOllamaServer`` recording the ``/api/chat`` body it received.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import openai
import pytest
import trio

from iopd.node.adapters.base import AdapterError
from iopd.node.adapters.ollama import to_ollama_format, to_ollama_messages
from tests.support.configs import gateway_yaml, node_entry, provider_entry
from tests.support.gateway import Gateway, in_thread, running_gateway
from tests.support.mock_providers import MockOllamaServer

SERVED = "mock:latest"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
PNG_B64 = base64.b64encode(PNG).decode()
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}


def _yaml(base_url: str) -> str:
    ollama = provider_entry(
        "ol-1", "ollama", base_url=base_url, models=f'["{SERVED}"]', health_interval=30
    )
    return gateway_yaml(
        edge_id="edge-ollama-format",
        models=f'  - id: llama\n    providers: {{ol-1: "{SERVED}"}}',
        nodes=node_entry("node-a", ollama),
    )


@asynccontextmanager
async def _gateway() -> AsyncIterator[tuple[Gateway, MockOllamaServer]]:
    mock = MockOllamaServer()
    async with trio.open_nursery() as n:
        await n.start(mock.serve)
        async with running_gateway(_yaml(mock.base_url)) as gw:
            yield gw, mock
        n.cancel_scope.cancel()


def _chat_bodies(mock: MockOllamaServer) -> list[dict[str, Any]]:
    return [r.json() for r in mock.requests if r.method == "POST" and r.path == "/api/chat"]


def _image_message(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


# ------------------------------------------------------------ end to end


async def test_response_format_reaches_ollama_as_format() -> None:
    with trio.fail_after(30):
        async with _gateway() as (gw, mock):
            client = gw.sdk()
            msgs = [{"role": "user", "content": "Where is the Eiffel tower? JSON."}]
            await in_thread(
                lambda: client.chat.completions.create(
                    model="llama", messages=msgs, response_format={"type": "json_object"}
                )
            )
            schema_format = {
                "type": "json_schema",
                "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
            }
            await in_thread(
                lambda: list(
                    client.chat.completions.create(
                        model="llama", messages=msgs, response_format=schema_format, stream=True
                    )
                )
            )
            await in_thread(
                lambda: client.chat.completions.create(
                    model="llama", messages=msgs, response_format={"type": "text"}
                )
            )
            await in_thread(lambda: client.chat.completions.create(model="llama", messages=msgs))
            formats = [b.get("format", "<absent>") for b in _chat_bodies(mock)]
            assert formats == ["json", SCHEMA, "<absent>", "<absent>"]


async def test_a_data_url_image_reaches_ollama_as_images() -> None:
    with trio.fail_after(30):
        async with _gateway() as (gw, mock):
            client = gw.sdk()
            url = f"data:image/png;base64,{PNG_B64}"
            reply = await in_thread(
                lambda: client.chat.completions.create(model="llama", messages=_image_message(url))
            )
            assert reply.choices[0].message.content == mock.reply_text
            (body,) = _chat_bodies(mock)
            (message,) = body["messages"]
            assert message == {
                "role": "user",
                "content": "What is in this picture?",
                "images": [PNG_B64],
            }
            assert base64.b64decode(message["images"][0]) == PNG


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://example.invalid/cat.png", "does not fetch image URLs"),
        ("data:image/png,raw-not-base64", "must be base64"),
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
    ],
)
async def test_an_image_ollama_cannot_take_is_a_400_before_the_provider(
    url: str, says: str
) -> None:
    with trio.fail_after(30):
        async with _gateway() as (gw, mock):
            client = gw.sdk()
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(
                    lambda: client.chat.completions.create(
                        model="llama", messages=_image_message(url)
                    )
                )
            assert says in info.value.message
            assert "messages[0].content[1]" in info.value.message
            assert _chat_bodies(mock) == []


async def test_an_unknown_response_format_type_is_a_400() -> None:
    with trio.fail_after(30):
        async with _gateway() as (gw, mock):
            client = gw.sdk()
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(
                    lambda: client.chat.completions.create(
                        model="llama",
                        messages=[{"role": "user", "content": "hi"}],
                        response_format={"type": "grammar"},  # type: ignore[arg-type,misc]
                    )
                )
            assert "response_format.type" in info.value.message
            assert _chat_bodies(mock) == []


# ------------------------------------------------------------ the mapping


def test_format_mapping() -> None:
    assert to_ollama_format(None) is None
    assert to_ollama_format({"type": "text"}) is None
    assert to_ollama_format({"type": "json_object"}) == "json"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert to_ollama_format(schema) == SCHEMA
    for bad in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 1}}):
        with pytest.raises(AdapterError) as info:
            to_ollama_format(bad)
        assert info.value.code == "bad_request"


def test_images_from_chat_and_responses_parts_and_wrapped_base64() -> None:
    wrapped = "\n".join(PNG_B64[i : i + 76] for i in range(0, len(PNG_B64), 76))
    messages = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {
            "role": "user",
            "content": [
                {"type": "input_image", "image_url": f"data:image/png;base64,{PNG_B64}"},
                {"type": "image_url", "image_url": {"url": f"DATA:image/png;BASE64,{wrapped}"}},
            ],
        },
    ]
    out = to_ollama_messages(messages)
    assert out[0] == {"role": "user", "content": "a"}
    assert out[1] == {"role": "user", "content": "", "images": [PNG_B64, PNG_B64]}


def test_a_part_ollama_cannot_take_is_named() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    with pytest.raises(AdapterError) as info:
        to_ollama_messages([{"role": "user", "content": [audio]}])
    assert info.value.code == "bad_request"
    assert "messages[0].content[0]" in str(info.value) and "input_audio" in str(info.value)
