"""``n > 1`` choices, through the official ``openai`` SDK.

Passthrough providers (vLLM, llama.cpp) get ``n`` relayed as sent.  On a
normalized provider the edge runs the request once per choice, one after the
other under the one lease (one provider slot), at most 8 choices: choices
indexed 0..n-1, usage summed, stream chunks carrying their choice's index.
"""

from __future__ import annotations

import openai
import pytest
import trio

from tests.support.configs import echo_yaml, gateway_yaml, http_provider, node_entry, remote_yaml
from tests.support.gateway import in_thread, running_gateway
from tests.support.mock_providers import MockOpenAIServer

MSGS = [{"role": "user", "content": "hello there"}]


async def test_normalized_n_runs_each_choice_on_one_slot() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml(capacity=1)) as gw:
            client = gw.sdk()
            one = await in_thread(lambda: client.chat.completions.create(model="echo", messages=MSGS))
            resp = await in_thread(
                lambda: client.chat.completions.create(model="echo", messages=MSGS, n=3)
            )
            assert [c.index for c in resp.choices] == [0, 1, 2]
            assert {c.message.content for c in resp.choices} == {"hello there"}
            assert {c.finish_reason for c in resp.choices} == {"stop"}
            assert one.usage is not None and resp.usage is not None
            assert resp.usage.prompt_tokens == 3 * one.usage.prompt_tokens
            assert resp.usage.completion_tokens == 3 * one.usage.completion_tokens
            assert resp.usage.total_tokens == 3 * one.usage.total_tokens
            # The lease is given back once, at the end.
            assert gw.runtime.pool.provider_loads()["echo-1"].in_flight == 0


async def test_normalized_n_stream_chunks_carry_their_choice_index() -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            chunks = await in_thread(
                lambda: list(
                    client.chat.completions.create(
                        model="echo",
                        messages=MSGS,
                        n=2,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
            )
            text: dict[int, str] = {}
            roles: dict[int, int] = {}
            finish: dict[int, str | None] = {}
            for chunk in chunks:
                for choice in chunk.choices:
                    text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
                    if choice.delta.role == "assistant":
                        roles[choice.index] = roles.get(choice.index, 0) + 1
                    if choice.finish_reason is not None:
                        finish[choice.index] = choice.finish_reason
            assert text == {0: "hello there", 1: "hello there"}
            assert roles == {0: 1, 1: 1}
            assert finish == {0: "stop", 1: "stop"}
            usage = chunks[-1].usage
            assert usage is not None and chunks[-1].choices == []
            assert usage.completion_tokens == 4  # two words, twice


async def test_normalized_text_tools_with_n() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    msgs = [{"role": "user", "content": call}]
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=msgs, tools=tools, n=2
                )
            )
            for choice in resp.choices:
                assert choice.finish_reason == "tool_calls"
                assert choice.message.tool_calls[0].function.name == "get_weather"
            chunks = await in_thread(
                lambda: list(
                    client.chat.completions.create(
                        model="echo", messages=msgs, tools=tools, n=2, stream=True
                    )
                )
            )
            called = [
                (c.index, tc.index, tc.function.name)
                for chunk in chunks
                for c in chunk.choices
                for tc in c.delta.tool_calls or []
            ]
            assert called == [(0, 0, "get_weather"), (1, 0, "get_weather")]


@pytest.mark.parametrize(("n", "message"), [(9, "at most 8"), (0, "at least 1")])
async def test_normalized_n_out_of_range_is_a_400_naming_n(n: int, message: str) -> None:
    with trio.fail_after(30):
        async with running_gateway(echo_yaml()) as gw:
            client = gw.sdk()
            with pytest.raises(openai.BadRequestError) as info:
                await in_thread(
                    lambda: client.chat.completions.create(model="echo", messages=MSGS, n=n)
                )
            assert info.value.param == "n"
            assert message in info.value.message


async def test_passthrough_relays_n_as_sent() -> None:
    yaml_text = remote_yaml("{base}")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            mock = await nursery.start(MockOpenAIServer().serve)
            async with running_gateway(yaml_text.replace("{base}", mock.base_url)) as gw:
                client = gw.sdk()
                for n in (3, 20):  # no cap: the provider decides
                    resp = await in_thread(
                        lambda n=n: client.chat.completions.create(
                            model="remote", messages=MSGS, n=n
                        )
                    )
                    assert resp.choices[0].message.content == mock.reply_text
                    assert mock.requests[-1].json()["n"] == n
            nursery.cancel_scope.cancel()


async def test_a_mixed_group_relays_what_only_passthrough_serves() -> None:
    """n over the normalized cap, and Responses' built-in tools, go to the passthrough provider."""
    providers = (
        "      - id: echo-1\n        type: echo\n        models: [echo]\n        capacity: 4\n"
        + http_provider("oa-1", "openai", "{base}", models="[mock-model]")
    )
    yaml_text = gateway_yaml(
        models="  - id: mix\n    providers: {echo-1: echo, oa-1: mock-model}\n",
        nodes=node_entry("node-a", providers),
    )
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            mock = await nursery.start(MockOpenAIServer().serve)
            async with running_gateway(yaml_text.replace("{base}", mock.base_url)) as gw:
                client = gw.sdk()
                for _ in range(3):
                    resp = await in_thread(
                        lambda: client.chat.completions.create(model="mix", messages=MSGS, n=9)
                    )
                    assert resp.choices[0].message.content == mock.reply_text
                    assert mock.requests[-1].json()["n"] == 9
                    web = await in_thread(
                        lambda: client.responses.create(
                            model="mix", input="q", tools=[{"type": "web_search"}]
                        )
                    )
                    assert web.output_text == mock.reply_text
                    assert mock.requests[-1].json()["tools"] == [{"type": "web_search"}]
            nursery.cancel_scope.cancel()
