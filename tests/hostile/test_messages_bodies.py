"""Hostile ``/v1/messages`` bodies: each a 400 in Anthropic's envelope, in bounded work.

The translation to chat walks the caller's blocks once; the body's size and
nesting are bounded before it is decoded (``json_body``).  Nothing here may
end in a traceback, a 500 or an OpenAI-shaped error.
"""

from __future__ import annotations

import json
from typing import Any

import trio

from tests.support.configs import echo_yaml
from tests.support.gateway import http_request, running_gateway


def _body(**fields: Any) -> bytes:
    doc = {"model": "echo", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]}
    doc.update(fields)
    return json.dumps(doc).encode()


CASES: list[tuple[str, bytes, str]] = [
    ("not json", b'{"model": "echo", ', "JSON"),
    ("an array", b"[1, 2]", "object"),
    (
        "nested too deeply",
        b'{"model": "echo", "system": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        "nested",
    ),
    (
        "blocks of numbers",
        _body(messages=[{"role": "user", "content": [1, 2, 3]}]),
        "messages[0].content[0]",
    ),
    ("a block without a type", _body(messages=[{"role": "user", "content": [{}]}]), "type"),
    (
        "tool input not an object",
        _body(
            messages=[
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "x"}],
                }
            ]
        ),
        "input",
    ),
    ("system of numbers", _body(system=7), "system"),
    ("tools not a list", _body(tools={"name": "f"}), "tools"),
    ("a huge max_tokens type", _body(max_tokens="many"), "max_tokens"),
    ("a boolean temperature", _body(temperature=True), "temperature"),
    ("stop sequences of objects", _body(stop_sequences=[{}]), "stop_sequences"),
    (
        "an image from a file",
        _body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}],
                }
            ]
        ),
        "source.type",
    ),
]


async def test_hostile_messages_bodies_are_anthropic_400s() -> None:
    with trio.fail_after(60):
        async with running_gateway(echo_yaml()) as gw:
            for name, body, said in CASES:
                resp = await http_request(gw.host_port, "POST", "/v1/messages", body=body)
                assert resp.status == 400, name
                doc = resp.json()
                assert doc["type"] == "error", name
                assert doc["error"]["type"] == "invalid_request_error", name
                assert said in doc["error"]["message"], (name, doc)
            many = [{"type": "text", "text": "a"}] * 1_500  # linear work: answered
            resp = await http_request(
                gw.host_port,
                "POST",
                "/v1/messages",
                body=_body(messages=[{"role": "user", "content": many}]),
            )
            assert resp.status == 200, resp.body[:300]
            assert resp.json()["content"][0]["text"] == "\n".join(["a"] * 1_500)
