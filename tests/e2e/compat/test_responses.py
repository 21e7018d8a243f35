"""``/v1/responses`` on normalized providers, through the
official ``openai`` SDK: ``client.responses.create`` and ``client.responses.stream``
(whose accumulator checks the event order, item identities and sequence).

Echo and cli run the ``<tool_call>`` text protocol, ollama native tool calls;
both answer ``function_call`` output items.  Passthrough ``/v1/responses``
stays a byte-exact relay (``tests/e2e/test_passthrough_relay.py``).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import trio

from tests.support.configs import (
    cli_provider,
    echo_yaml,
    gateway_yaml,
    node_entry,
    ollama_only_yaml,
)
from tests.support.gateway import in_thread, running_gateway
from tests.support.mock_providers import MockOllamaServer

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'

# What LangChain's ChatOpenAI(use_responses_api=True) and SDK users send.
LIST_INPUT: list[Any] = [
    {"role": "developer", "content": "be brief"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"}]},
    {"role": "assistant", "content": "an earlier answer"},
    {"role": "user", "content": [{"type": "input_text", "text": "echo me back"}]},
]

EXPECTED_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 3,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


async def test_list_input_and_instructions_on_echo() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.responses.create(
                    model="echo", input=LIST_INPUT, instructions="answer in English"
                )
            )
            assert resp.output_text == "echo me back"
            assert resp.status == "completed"
            assert resp.usage is not None and resp.usage.output_tokens == 3
            # A plain string content and a system role are fine too.
            resp = await in_thread(
                lambda: client.responses.create(
                    model="echo",
                    input=[{"role": "system", "content": "s"}, {"role": "user", "content": "x y"}],
                )
            )
            assert resp.output_text == "x y"


async def test_stream_event_sequence_on_echo() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()

            def with_helper() -> tuple[list[Any], Any]:
                with client.responses.stream(model="echo", input=LIST_INPUT) as stream:
                    events = list(stream)
                    return events, stream.get_final_response()

            events, final = await in_thread(with_helper)
            assert [e.type for e in events] == EXPECTED_EVENTS
            assert [e.sequence_number for e in events] == list(range(len(EXPECTED_EVENTS)))
            deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert deltas == "echo me back" == final.output_text
            assert final.usage is not None and final.usage.output_tokens == 3

            raw = await in_thread(
                lambda: list(client.responses.create(model="echo", input="a b c", stream=True))
            )
            assert [e.type for e in raw] == EXPECTED_EVENTS
            assert raw[-1].response.output_text == "a b c"
            assert raw[0].response.id == raw[-1].response.id


def _function_calls(resp: Any) -> list[tuple[str, dict[str, Any]]]:
    return [
        (item.name, json.loads(item.arguments))
        for item in resp.output
        if item.type == "function_call"
    ]


async def test_function_tools_on_echo_text_protocol() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.responses.create(model="echo", input=CALL_TEXT, tools=TOOLS)
            )
            assert _function_calls(resp) == [("get_weather", {"city": "Oslo"})]
            assert resp.output_text == ""
            assert resp.tools[0].name == "get_weather"  # type: ignore[union-attr]

            def streamed() -> tuple[list[str], Any]:
                with client.responses.stream(model="echo", input=CALL_TEXT, tools=TOOLS) as s:
                    return [e.type for e in s], s.get_final_response()

            kinds, final = await in_thread(streamed)
            assert "response.output_text.delta" not in kinds  # the text became the call
            assert "response.function_call_arguments.done" in kinds
            assert _function_calls(final) == [("get_weather", {"city": "Oslo"})]

            # The tool loop: the call and its output go back, then the user goes on.
            call = next(item for item in resp.output if item.type == "function_call")
            loop_input: list[Any] = [
                {"role": "user", "content": CALL_TEXT},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
                {"role": "user", "content": "thanks"},
            ]
            again = await in_thread(
                lambda: client.responses.create(model="echo", input=loop_input, tools=TOOLS)
            )
            assert again.output_text == "thanks" and _function_calls(again) == []


async def test_what_needs_a_passthrough_provider_is_a_clear_400() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(
                    lambda: client.responses.create(
                        model="echo", input="x", previous_response_id="resp_1"
                    )
                )
            assert info.value.param == "previous_response_id"
            assert "the edge keeps no responses" in info.value.message


async def test_native_tool_calls_on_ollama() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            mock = await nursery.start(MockOllamaServer().serve)
            mock.tool_calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
            yaml_text = ollama_only_yaml(mock.base_url, "llama")
            async with running_gateway(yaml_text) as gw:
                client = gw.sdk()
                resp = await in_thread(
                    lambda: client.responses.create(
                        model="llama", input=LIST_INPUT, instructions="hi", tools=TOOLS
                    )
                )
                assert _function_calls(resp) == [("get_weather", {"city": "Oslo"})]
                assert resp.output_text == mock.reply_text
                sent = mock.requests[-1].json()
                assert sent["tools"][0]["function"]["name"] == "get_weather"
                assert sent["messages"][0] == {"role": "system", "content": "hi"}
                assert sent["messages"][-1]["content"] == "echo me back"

                def streamed() -> tuple[list[str], Any]:
                    with client.responses.stream(model="llama", input="q", tools=TOOLS) as s:
                        return [e.type for e in s], s.get_final_response()

                kinds, final = await in_thread(streamed)
                assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
                assert "response.output_text.delta" in kinds
                assert _function_calls(final) == [("get_weather", {"city": "Oslo"})]
                assert final.output_text == mock.reply_text
            nursery.cancel_scope.cancel()


async def test_stream_on_cli() -> None:
    script = "import sys; sys.stdin.read(); print('from the cli')"
    yaml_text = gateway_yaml(
        models="  - id: cli\n    providers: {cli-1: cli}\n",
        nodes=node_entry("node-a", cli_provider("cli-1", script)),
    )
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            client = gw.sdk()

            def streamed() -> Any:
                with client.responses.stream(model="cli", input=LIST_INPUT) as s:
                    for _ in s:
                        pass
                    return s.get_final_response()

            final = await in_thread(streamed)
            assert final.output_text.strip() == "from the cli"
