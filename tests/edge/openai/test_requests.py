"""Request body parsing and validation: every mistake is a clear 400 naming its param."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from iopd.edge.openai.incoming import json_body
from iopd.edge.openai.incoming.requests import (
    ChatRequest,
    OllamaRequest,
    ResponsesRequest,
    parse_json_object,
    rewrite_model,
)
from iopd.errors import InvalidRequest

USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [USER]}
    for key, value in fields.items():
        if value is ...:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def tool(name: Any = "get_weather", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


def meta(n: int) -> dict[str, str]:
    return {f"k{i}": "v" for i in range(n)}


# (id, body, expected param)
CHAT_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("model missing", chat(model=...), "model"),
    ("model null", chat(model=None), "model"),
    ("model number", chat(model=3), "model"),
    ("model empty", chat(model=""), "model"),
    ("model blank", chat(model="   "), "model"),
    ("model list", chat(model=["m"]), "model"),
    ("messages missing", chat(messages=...), "messages"),
    ("messages empty", chat(messages=[]), "messages"),
    ("messages object", chat(messages={"role": "user"}), "messages"),
    ("messages string", chat(messages="hi"), "messages"),
    ("message not object", chat(messages=["hi"]), "messages[0]"),
    ("role missing", chat(messages=[{"content": "x"}]), "messages[0].role"),
    ("role bad", chat(messages=[USER, {"role": "robot", "content": "x"}]), "messages[1].role"),
    ("role number", chat(messages=[{"role": 1, "content": "x"}]), "messages[0].role"),
    ("role upper", chat(messages=[{"role": "User", "content": "x"}]), "messages[0].role"),
    ("content number", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("content object", chat(messages=[{"role": "user", "content": {}}]), "messages[0].content"),
    ("content missing user", chat(messages=[{"role": "user"}]), "messages[0].content"),
    (
        "content null user",
        chat(messages=[{"role": "user", "content": None}]),
        "messages[0].content",
    ),
    (
        "content null assistant without tool_calls",
        chat(messages=[USER, {"role": "assistant", "content": None}]),
        "messages[1].content",
    ),
    (
        "part not object",
        chat(messages=[{"role": "user", "content": ["x"]}]),
        "messages[0].content[0]",
    ),
    (
        "part without type",
        chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
        "messages[0].content[0].type",
    ),
    (
        "text part without text",
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content[0].text",
    ),
    (
        "text part number text",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
        "messages[0].content[0].text",
    ),
    (
        "tool_calls not list",
        chat(messages=[{"role": "assistant", "content": None, "tool_calls": {"id": "1"}}]),
        "messages[0].tool_calls",
    ),
    (
        "tool_calls on user",
        chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]),
        "messages[0].tool_calls",
    ),
    (
        "tool message without tool_call_id",
        chat(messages=[{"role": "tool", "content": "42"}]),
        "messages[0].tool_call_id",
    ),
    (
        "name number",
        chat(messages=[{"role": "user", "content": "x", "name": 7}]),
        "messages[0].name",
    ),
    ("stream string", chat(stream="true"), "stream"),
    ("stream number", chat(stream=1), "stream"),
    ("stream_options not object", chat(stream_options=True), "stream_options"),
    (
        "include_usage string",
        chat(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    ("temperature string", chat(temperature="0.5"), "temperature"),
    ("temperature bool", chat(temperature=True), "temperature"),
    ("temperature high", chat(temperature=2.5), "temperature"),
    ("temperature negative", chat(temperature=-0.1), "temperature"),
    ("top_p high", chat(top_p=1.5), "top_p"),
    ("top_p bool", chat(top_p=False), "top_p"),
    ("max_tokens zero", chat(max_tokens=0), "max_tokens"),
    ("max_tokens negative", chat(max_tokens=-5), "max_tokens"),
    ("max_tokens fraction", chat(max_tokens=10.5), "max_tokens"),
    ("max_tokens string", chat(max_tokens="100"), "max_tokens"),
    ("max_tokens bool", chat(max_tokens=True), "max_tokens"),
    ("max_completion_tokens zero", chat(max_completion_tokens=0), "max_completion_tokens"),
    ("n fraction", chat(n=1.5), "n"),
    ("n zero", chat(n=0), "n"),
    ("n bool", chat(n=True), "n"),
    ("n string", chat(n="1"), "n"),
    ("stop number", chat(stop=5), "stop"),
    ("stop five", chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("stop list with number", chat(stop=["a", 1]), "stop"),
    ("presence_penalty high", chat(presence_penalty=3), "presence_penalty"),
    ("frequency_penalty low", chat(frequency_penalty=-2.5), "frequency_penalty"),
    ("frequency_penalty bool", chat(frequency_penalty=True), "frequency_penalty"),
    ("seed fraction", chat(seed=1.5), "seed"),
    ("seed string", chat(seed="42"), "seed"),
    ("seed bool", chat(seed=False), "seed"),
    ("user number", chat(user=12), "user"),
    ("response_format string", chat(response_format="json"), "response_format"),
    ("metadata list", chat(metadata=["a"]), "metadata"),
    ("metadata 17 entries", chat(metadata=meta(17)), "metadata"),
    ("metadata number value", chat(metadata={"team": 5}), "metadata.team"),
    ("metadata null value", chat(metadata={"team": None}), "metadata.team"),
    ("metadata bool value", chat(metadata={"team": True}), "metadata.team"),
    ("metadata long key", chat(metadata={"k" * 65: "v"}), "metadata"),
    ("metadata long value", chat(metadata={"k": "v" * 513}), "metadata.k"),
    ("metadata workspace number", chat(metadata={"workspace": 1}), "metadata.workspace"),
    ("tools object", chat(tools={"type": "function"}), "tools"),
    ("tool not object", chat(tools=["f"]), "tools[0]"),
    (
        "tool wrong type",
        chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
        "tools[0].type",
    ),
    ("tool without function", chat(tools=[{"type": "function"}]), "tools[0].function"),
    (
        "tool name missing",
        chat(tools=[{"type": "function", "function": {}}]),
        "tools[0].function.name",
    ),
    ("tool name space", chat(tools=[tool("get weather")]), "tools[0].function.name"),
    ("tool name dot", chat(tools=[tool("a.b")]), "tools[0].function.name"),
    ("tool name too long", chat(tools=[tool("a" * 65)]), "tools[0].function.name"),
    ("tool name empty", chat(tools=[tool("")]), "tools[0].function.name"),
    ("tool name number", chat(tools=[tool(5)]), "tools[0].function.name"),
    ("tool name unicode", chat(tools=[tool("wetter_é")]), "tools[0].function.name"),
    ("second tool bad", chat(tools=[tool(), tool("bad name")]), "tools[1].function.name"),
    (
        "tool parameters not object",
        chat(tools=[tool(parameters="{}")]),
        "tools[0].function.parameters",
    ),
    (
        "tool description number",
        chat(tools=[tool(description=1)]),
        "tools[0].function.description",
    ),
    ("tool_choice unknown mode", chat(tool_choice="always"), "tool_choice"),
    ("tool_choice number", chat(tool_choice=1), "tool_choice"),
    (
        "tool_choice function without name",
        chat(tool_choice={"type": "function", "function": {}}),
        "tool_choice.function.name",
    ),
]


@pytest.mark.parametrize(
    ("body", "param"), [c[1:] for c in CHAT_CASES], ids=[c[0] for c in CHAT_CASES]
)
def test_malformed_chat_requests(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ChatRequest.parse(body)
    assert info.value.param == param
    assert info.value.status == 400
    assert "Traceback" not in info.value.message
    # the same through raw bytes
    with pytest.raises(InvalidRequest) as again:
        ChatRequest.parse(json.dumps(body).encode())
    assert again.value.param == param


def test_there_are_at_least_fifty_malformed_cases() -> None:
    assert len(CHAT_CASES) >= 50


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"   ",
        b"{",
        b"{'model': 'm'}",
        b'{"model": "m",}',
        b"null",
        b"[]",
        b'"text"',
        b"42",
        b'{"model": "\xff\xfe"}',
        b"\xff\xfe{}",
        b'{"a": 1} trailing',
        b"NaN",
    ],
)
def test_parse_json_object_rejects(body: bytes) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_json_object(body)
    assert info.value.status == 400
    assert info.value.param is None


def test_parse_json_object_accepts_an_object() -> None:
    assert parse_json_object(b' {"model": "m", "x": [1, 2]} ') == {"model": "m", "x": [1, 2]}


def test_valid_chat_request_view_and_params() -> None:
    body = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": "dev"}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "function", "name": "f", "content": "42"},
        ],
        stream=True,
        stream_options={"include_usage": True},
        tools=[tool("get_weather-2", description="d", parameters={"type": "object"}, strict=True)],
        tool_choice={"type": "function", "function": {"name": "get_weather-2"}},
        temperature=0,
        top_p=1,
        max_tokens=100,
        max_completion_tokens=50,
        n=1,
        stop=["a", "b", "c", "d"],
        presence_penalty=-2,
        frequency_penalty=2.0,
        seed=7,
        user="u",
        metadata={**meta(16), "workspace": "/srv/w" + "x" * 600},
        response_format={"type": "json_object"},
        logprobs=True,
        some_future_field={"kept": True},
    )
    req = ChatRequest.parse(body)
    assert req.raw is body
    assert req.model == "m"
    assert req.stream and req.include_usage
    assert req.tools is not None and req.tools[0]["function"]["name"] == "get_weather-2"
    assert req.workspace is not None and req.workspace.startswith("/srv/w")
    assert len(req.metadata) == 17
    assert req.params() == {
        "temperature": 0,
        "top_p": 1,
        "presence_penalty": -2,
        "frequency_penalty": 2.0,
        "seed": 7,
        "stop": ["a", "b", "c", "d"],
        "max_tokens": 50,
        "response_format": {"type": "json_object"},  # for the normalized adapters to map
    }
    assert req.params() is not req.params()


def test_chat_nulls_are_absent() -> None:
    req = ChatRequest.parse(
        chat(temperature=None, stream=None, n=None, stop=None, tools=None, metadata=None)
    )
    assert req.params() == {} and not req.stream and req.tools is None and req.metadata == {}


def test_integral_float_max_tokens_is_accepted() -> None:
    assert ChatRequest.parse(chat(max_tokens=64.0)).params() == {"max_tokens": 64}


RESPONSES_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("model missing", {"input": "hi"}, "model"),
    ("model number", {"model": 1, "input": "hi"}, "model"),
    ("input number", {"model": "m", "input": 3}, "input"),
    ("input object", {"model": "m", "input": {"text": "x"}}, "input"),
    ("instructions list", {"model": "m", "input": "x", "instructions": ["a"]}, "instructions"),
    ("stream string", {"model": "m", "input": "x", "stream": "yes"}, "stream"),
    (
        "max_output_tokens zero",
        {"model": "m", "input": "x", "max_output_tokens": 0},
        "max_output_tokens",
    ),
    (
        "max_output_tokens bool",
        {"model": "m", "input": "x", "max_output_tokens": True},
        "max_output_tokens",
    ),
    ("temperature high", {"model": "m", "input": "x", "temperature": 9}, "temperature"),
    ("metadata too many", {"model": "m", "input": "x", "metadata": meta(17)}, "metadata"),
    ("metadata number", {"model": "m", "input": "x", "metadata": {"a": 1}}, "metadata.a"),
    ("tools not list", {"model": "m", "input": "x", "tools": {}}, "tools"),
    ("tool not object", {"model": "m", "input": "x", "tools": ["web"]}, "tools[0]"),
]


@pytest.mark.parametrize(
    ("body", "param"), [c[1:] for c in RESPONSES_CASES], ids=[c[0] for c in RESPONSES_CASES]
)
def test_malformed_responses_requests(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        ResponsesRequest.parse(body)
    assert info.value.param == param


def test_responses_request_keeps_unknown_fields() -> None:
    body = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "instructions": "be nice",
        "stream": True,
        "max_output_tokens": 256,
        "temperature": 0.2,
        "tools": [{"type": "web_search"}],
        "metadata": {"workspace": "/w"},
        "reasoning": {"effort": "high"},
        "prompt_cache_key": "codex-1",
    }
    req = ResponsesRequest.parse(body)
    assert req.raw is body and req.stream and req.instructions == "be nice"
    # reasoning.effort is mapped (ollama: think); the body keeps it for a relay.
    assert req.params() == {"temperature": 0.2, "max_tokens": 256, "reasoning_effort": "high"}
    assert req.workspace == "/w"
    assert json.loads(rewrite_model(req.raw, "served"))["reasoning"] == {"effort": "high"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "model"),
        ({"model": ""}, "model"),
        ({"model": "m", "stream": "no"}, "stream"),
        ({"model": "m", "options": []}, "options"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "prompt": 5}, "prompt"),
    ],
)
def test_malformed_ollama_requests(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        OllamaRequest.parse(body)
    assert info.value.param == param


def test_ollama_request() -> None:
    req = OllamaRequest.parse(
        b'{"model": "qwen3:32b", "messages": [], "options": {"temperature": 0.1, "num_predict": 9}}'
    )
    assert req.model == "qwen3:32b" and req.stream  # Ollama streams by default
    assert req.params() == {"temperature": 0.1, "max_tokens": 9}


def test_rewrite_model_replaces_only_the_model() -> None:
    raw = {"model": "alias", "messages": [USER], "x": {"y": [1, None, "é"]}}
    out = rewrite_model(raw, "Qwen/Qwen3-32B")
    assert msgspec.json.decode(out) == {**raw, "model": "Qwen/Qwen3-32B"}
    assert raw["model"] == "alias"
    assert list(json.loads(out)) == ["model", "messages", "x"]  # key order kept


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ("not-an-object", "messages[1].tool_calls[0]"),
        ({"function": None}, "messages[1].tool_calls[0].function"),
        ({"function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
        ({"function": {"name": "f", "arguments": 5}}, "messages[1].tool_calls[0].function.arguments"),
        ({"id": 7, "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].id"),
    ],
)
def test_earlier_tool_calls_are_validated(call: object, param: str) -> None:
    """A malformed earlier tool call is the caller's 400, never a node-side crash (502)."""
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ],
    }
    with pytest.raises(InvalidRequest) as info:
        ChatRequest.parse(body)
    assert info.value.param == param


def test_well_formed_earlier_tool_call_passes() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
    }
    assert ChatRequest.parse(body).messages[1]["tool_calls"] == [call]


# ------------------------------------------------------- decode cost bound


def _padded(item: bytes, size: int = 256 * 1024) -> bytes:
    n = size // (len(item) + 1)
    return b'{"model":"m","x":[' + b",".join([item] * n) + b"]}"


ESTIMATE_SHAPES = [
    b"[]", b"{}", b"0", b"300", b"12345", b"1.5", b"true", b'""', b'"ab"', b'"\\"x\\\\"',
    b'{"a":1}', b'{"abcdefgh":[1,2]}', b"[[]]", b'"a,b:c[d{"', "\"é😀\"".encode(),
]


@pytest.mark.parametrize("item", ESTIMATE_SHAPES)
def test_estimate_is_above_what_decoding_takes(item: bytes) -> None:
    import gc
    import tracemalloc

    body = _padded(item)
    gc.collect()
    tracemalloc.start()
    try:
        value = msgspec.json.decode(body)
        taken = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del value
    assert json_body.estimated_decoded_bytes(body) >= taken


def test_strings_content_is_not_counted_as_structure() -> None:
    # Commas and brackets inside strings (JSON pasted in a message) are not values.
    text = json.dumps({"a": [1, 2, 3], "b": {"c": [{}]}}) * 10_000
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    assert json_body.estimated_decoded_bytes(body) < 2 * len(body)


@pytest.mark.parametrize("item", [b"[]", b"{}", b"0", b'{"a":1}', b'""', b'","'])
def test_large_body_of_tiny_values_is_refused(item: bytes) -> None:
    body = _padded(item, 2 * 1024 * 1024)
    with pytest.raises(InvalidRequest, match="too costly to decode"):
        json_body.parse_json_object(body)


def test_dense_five_digit_token_ids_pass() -> None:
    ids = b",".join(str(10_000 + i % 90_000).encode() for i in range(1_000_000))
    body = b'{"model":"m","x":[' + ids + b"]}"
    assert len(body) > 5 * 1024 * 1024
    assert len(json_body.parse_json_object(body)["x"]) == 1_000_000


def test_small_bodies_are_not_priced() -> None:
    body = _padded(b"[]", json_body.DECODE_CHECK_FROM_BYTES - 64)
    assert json_body.estimated_decoded_bytes(body) > json_body.DECODE_COST_FACTOR * len(body)
    assert json_body.parse_json_object(body)["model"] == "m"


def test_whitespace_only_body_is_empty() -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        json_body.parse_json_object(b" \r\n\t\x0b\x0c")


def test_relayed_body_is_the_same_value_spelled_compactly() -> None:
    """What docs/compatibility.md says a passthrough provider gets of a body."""
    raw = b'{ "model" : "alias", "x": "\\/ \\u00e9 \\u003c", "n": 2.50, "e": 1e2, "d": 1, "d": 2 }'
    sent = rewrite_model(parse_json_object(raw), "served")
    assert sent == '{"model":"served","x":"/ \u00e9 <","n":2.5,"e":100.0,"d":2}'.encode()
