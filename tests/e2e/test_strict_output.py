"""Strict output end to end: the instruction reaches a ``cli`` provider and only what is inside
``<completion>`` comes back; with echo, streamed and not."""

from __future__ import annotations

import base64

import trio

from iopd.config.schema import DEFAULT_STRICT_OUTPUT_INSTRUCTION
from tests.support.configs import cli_provider, echo_entry, gateway_yaml, node_entry
from tests.support.gateway import http_request, in_thread, running_gateway
from tests.support.replies import chat_body, streamed_text

CHAT = "/v1/chat/completions"


# Prints the prompt it received base64-encoded inside <completion>, with noise
# around: the edge must return only the inside.
STDIN_B64_SCRIPT = (
    "import sys, base64; d = sys.stdin.buffer.read(); "
    "print('noise before <completion>' + base64.b64encode(d).decode() + '</completion> after')"
)


async def test_strict_output_instruction_reaches_cli_and_only_inside_returns() -> None:
    yaml_text = gateway_yaml(
        models="  - id: cli\n    providers: {cli-1: cli}\n",
        nodes=node_entry("node-a", cli_provider("cli-1", STDIN_B64_SCRIPT)),
        openai_extra="  strict_output: true",
    )
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            for stream in (False, True):
                r = await http_request(
                    gw.host_port, "POST", CHAT, body=chat_body("cli", "question?", stream=stream)
                )
                assert r.status == 200, r.body
                text = (
                    streamed_text(r.body)
                    if stream
                    else r.json()["choices"][0]["message"]["content"]
                )
                prompt = base64.b64decode(text.strip()).decode()
                # The system instruction comes before the caller's message.
                assert DEFAULT_STRICT_OUTPUT_INSTRUCTION in prompt
                assert prompt.index(DEFAULT_STRICT_OUTPUT_INSTRUCTION) < prompt.index("question?")


async def test_strict_output_with_echo_streaming_and_not() -> None:
    yaml_text = gateway_yaml(
        models="  - id: echo\n    providers: {echo-1: echo}\n",
        nodes=node_entry("node-a", echo_entry(delay_ms=0)),
        openai_extra="  strict_output: true",
    )
    said = "chatter <completion>inside words</completion> trailing"
    with trio.fail_after(30):
        async with running_gateway(yaml_text) as gw:
            client = gw.sdk()
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": said}]
                )
            )
            assert resp.choices[0].message.content == "inside words"

            def stream() -> str:
                out = ""
                for chunk in client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": said}], stream=True
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        out += chunk.choices[0].delta.content
                return out

            assert (await in_thread(stream)).strip() == "inside words"
            # Without the element the whole text comes back.
            resp = await in_thread(
                lambda: client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "no tags here"}]
                )
            )
            assert resp.choices[0].message.content == "no tags here"
