"""chat.completion and chat.completion.chunk assembly from RunEvents.

Exact dicts/bytes for representative event sequences, and every produced
object validated with the official SDK's pydantic models.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from iopd.edge.openai.outgoing.chat import (
    ChunkStream,
    CompletionAssembler,
    merge_usage,
    new_completion_id,
    openai_finish_reason,
    usage_dict,
)
from iopd.edge.openai.outgoing.sse import SSE_DONE, SSE_HEADERS, sse_data
from iopd.errors import ProviderError
from wire.messages import RunEvent, Usage

CID = "chatcmpl-test"
MODEL = "qwen3.6:35b"
CREATED = 1_700_000_000


def ev(kind: str, **kw: Any) -> RunEvent:
    return RunEvent(stream_id=1, kind=kind, **kw)  # type: ignore[arg-type]


def assemble(*events: RunEvent) -> CompletionAssembler:
    asm = CompletionAssembler(completion_id=CID, model=MODEL, created=CREATED)
    for event in events:
        if event.kind == "complete":
            asm.finish(event)
        else:
            asm.feed(event)
    return asm


def completion(
    message: dict[str, Any], finish: str, usage: dict[str, Any] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": CID,
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def check_sdk(result: dict[str, Any]) -> ChatCompletion:
    # Round-trip through JSON first: what the caller receives is bytes.
    return ChatCompletion.model_validate(json.loads(msgspec.json.encode(result)))


# ----------------------------------------------------------- non-streaming


def test_text_only() -> None:
    asm = assemble(
        ev("text", text="Hello "),
        ev("text", text="world"),
        ev("usage", usage=Usage(input_tokens=5, output_tokens=2)),
        ev("complete", finish_reason="stop"),
    )
    result = asm.result()
    assert result == completion(
        {"role": "assistant", "content": "Hello world"},
        "stop",
        {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    )
    parsed = check_sdk(result)
    assert parsed.choices[0].message.content == "Hello world"
    assert parsed.usage is not None and parsed.usage.total_tokens == 7
    assert asm.text == "Hello world" and asm.reasoning_text == "" and not asm.saw_reasoning


def test_reasoning_then_text() -> None:
    asm = assemble(
        ev("reasoning", text="think "),
        ev("reasoning", text="hard"),
        ev("text", text="42"),
        ev("complete"),
    )
    result = asm.result()
    assert result == completion(
        {"role": "assistant", "content": "42", "reasoning_content": "think hard"}, "stop", None
    )
    parsed = check_sdk(result)
    assert parsed.choices[0].message.model_extra == {"reasoning_content": "think hard"}
    assert asm.reasoning_text == "think hard" and asm.saw_reasoning


def test_usage_with_reasoning_and_cached_tokens() -> None:
    asm = assemble(
        ev("text", text="x"),
        ev("usage", usage=Usage(input_tokens=100, output_tokens=30)),
        ev("complete", usage=Usage(reasoning_tokens=20, cached_input_tokens=64)),
    )
    usage = asm.result()["usage"]
    assert usage == {
        "prompt_tokens": 100,
        "completion_tokens": 30,
        "total_tokens": 130,
        "completion_tokens_details": {"reasoning_tokens": 20},
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    parsed = check_sdk(asm.result())
    assert parsed.usage is not None
    assert parsed.usage.completion_tokens_details is not None
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 20
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 64
    assert asm.usage == Usage(
        input_tokens=100, output_tokens=30, reasoning_tokens=20, cached_input_tokens=64
    )


def test_finish_reason_length_passes_through() -> None:
    asm = assemble(ev("text", text="trunc"), ev("complete", finish_reason="length"))
    assert asm.result()["choices"][0]["finish_reason"] == "length"
    assert asm.finish_reason == "length"
    check_sdk(asm.result())


def test_native_tool_calls_openai_and_ollama_shapes() -> None:
    asm = assemble(
        ev(
            "tool_call",
            tool_call={
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
        ),
        # Ollama: no id, no type, arguments as an object.
        ev("tool_call", tool_call={"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}),
        ev("complete", finish_reason="stop"),
    )
    result = asm.result()
    message = result["choices"][0]["message"]
    assert message["content"] is None
    assert result["choices"][0]["finish_reason"] == "tool_calls"
    first, second = message["tool_calls"]
    assert first == {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }
    assert second["id"].startswith("call_") and len(second["id"]) > len("call_")
    assert second["type"] == "function"
    assert second["function"] == {"name": "get_time", "arguments": '{"tz":"UTC"}'}
    parsed = check_sdk(result)
    calls = parsed.choices[0].message.tool_calls
    assert calls is not None
    assert [c.function.name for c in calls if c.type == "function"] == ["get_weather", "get_time"]


def test_tool_calls_from_complete_metadata() -> None:
    calls = [{"id": "call_1", "function": {"name": "f", "arguments": {"a": 1}}}]
    asm = assemble(
        ev("text", text="calling f"),
        ev("complete", metadata={"openai_tool_calls": json.dumps(calls)}),
    )
    message = asm.result()["choices"][0]["message"]
    assert message["content"] == "calling f"
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    ]
    assert asm.metadata["openai_tool_calls"] == json.dumps(calls)
    check_sdk(asm.result())


def test_same_call_as_event_and_metadata_is_counted_once() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asm = assemble(
        ev("tool_call", tool_call=call),
        ev("complete", metadata={"openai_tool_calls": json.dumps([call])}),
    )
    assert asm.result()["choices"][0]["message"]["tool_calls"] == [call]


def test_malformed_tool_call_metadata_is_a_provider_error() -> None:
    asm = CompletionAssembler(completion_id=CID, model=MODEL, created=CREATED)
    with pytest.raises(ProviderError):
        asm.finish(ev("complete", metadata={"openai_tool_calls": "[{not json"}))
    with pytest.raises(ProviderError):
        asm.feed(ev("tool_call", tool_call={"function": {"arguments": "{}"}}))


def test_overrides_for_text_tool_calls_and_strict_output() -> None:
    asm = assemble(
        ev("text", text='<tool_call>{"name":"f","arguments":{}}</tool_call>'), ev("complete")
    )
    parsed_call = {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    result = asm.result(text_override="", tool_calls_override=[parsed_call])
    assert result["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [parsed_call],
    }
    assert result["choices"][0]["finish_reason"] == "tool_calls"
    check_sdk(result)
    # A TextToolResult's None content passes straight through: no raw blocks leak.
    assert asm.result(None, [parsed_call])["choices"][0]["message"]["content"] is None
    # Strict output: the override replaces the text, nothing else changes.
    plain = assemble(ev("text", text="<completion>7</completion>"), ev("complete")).result(
        text_override="7"
    )
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "7"}


def test_tool_calls_finish_reason_without_calls_becomes_stop() -> None:
    asm = assemble(ev("text", text="plain"), ev("complete", finish_reason="tool_calls"))
    assert asm.result()["choices"][0]["finish_reason"] == "stop"
    # An explicit empty override drops native calls.
    asm2 = assemble(
        ev("tool_call", tool_call={"function": {"name": "f", "arguments": {}}}), ev("complete")
    )
    result = asm2.result(text_override="fallback text", tool_calls_override=[])
    assert result["choices"][0]["message"] == {"role": "assistant", "content": "fallback text"}
    assert result["choices"][0]["finish_reason"] == "stop"


def test_empty_run_has_empty_string_content() -> None:
    result = assemble(ev("complete")).result()
    assert result["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert "usage" not in result
    check_sdk(result)


def test_feed_rejects_error_events_and_finish_needs_complete() -> None:
    asm = CompletionAssembler(completion_id=CID, model=MODEL, created=CREATED)
    with pytest.raises(ValueError):
        asm.feed(ev("error", code="provider_error"))
    with pytest.raises(ValueError):
        asm.finish(ev("text", text="x"))
    asm.feed(ev("complete", finish_reason="length"))  # feed forwards complete to finish
    assert asm.finished and asm.finish_reason == "length"


@pytest.mark.parametrize(
    ("reason", "has_calls", "expected"),
    [
        (None, False, "stop"),
        ("stop", False, "stop"),
        ("load", False, "stop"),
        ("length", False, "length"),
        ("length", True, "length"),
        ("content_filter", False, "content_filter"),
        (None, True, "tool_calls"),
        ("stop", True, "tool_calls"),
        ("tool_calls", False, "stop"),
    ],
)
def test_openai_finish_reason(reason: str | None, has_calls: bool, expected: str) -> None:
    assert openai_finish_reason(reason, has_tool_calls=has_calls) == expected


def test_usage_helpers() -> None:
    assert usage_dict(None) is None
    assert usage_dict(Usage(output_tokens=3)) == {
        "prompt_tokens": 0,
        "completion_tokens": 3,
        "total_tokens": 3,
    }
    merged = merge_usage(Usage(input_tokens=1, output_tokens=2), Usage(output_tokens=5))
    assert merged == Usage(input_tokens=1, output_tokens=5)
    assert merge_usage(None, None) is None
    assert new_completion_id().startswith("chatcmpl-")
    assert new_completion_id() != new_completion_id()


# ------------------------------------------------------------- streaming


def decode_events(stream: bytes) -> list[Any]:
    """Split SSE bytes into decoded JSON payloads ("[DONE]" kept as a string)."""
    assert stream.endswith(b"\n\n")
    out: list[Any] = []
    for event in stream.split(b"\n\n")[:-1]:
        assert event.startswith(b"data: ")
        payload = event[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": CID,
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        **extra,
    }


def test_sse_framing() -> None:
    assert sse_data({"a": 1, "b": "é"}) == b'data: {"a":1,"b":"\xc3\xa9"}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert dict(SSE_HEADERS) == {
        "content-type": "text/event-stream",
        "cache-control": "no-cache",
        "x-accel-buffering": "no",
    }


def test_stream_text_exact_bytes_without_usage() -> None:
    cs = ChunkStream(completion_id=CID, model=MODEL, created=CREATED, include_usage=False)
    head = (
        b'{"id":"chatcmpl-test","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"qwen3.6:35b","choices":[{"index":0,"delta":'
    )
    assert (
        cs.first()
        == b"data: "
        + head
        + b'{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert (
        cs.text("Hi")
        == b"data: " + head + b'{"content":"Hi"},"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert cs.finish("stop", Usage(input_tokens=1, output_tokens=1)) == (
        b"data: " + head + b'{},"logprobs":null,"finish_reason":"stop"}]}\n\n' + SSE_DONE
    )


def test_stream_with_usage_reasoning_and_sdk_validation() -> None:
    cs = ChunkStream(completion_id=CID, model=MODEL, created=CREATED, include_usage=True)
    stream = (
        cs.first()
        + cs.reasoning("hmm")
        + cs.text("4")
        + cs.text("2")
        + cs.finish("stop", Usage(input_tokens=9, output_tokens=3, reasoning_tokens=1))
    )
    events = decode_events(stream)
    assert events == [
        chunk({"role": "assistant", "content": ""}, usage=None),
        chunk({"reasoning_content": "hmm"}, usage=None),
        chunk({"content": "4"}, usage=None),
        chunk({"content": "2"}, usage=None),
        chunk({}, "stop", usage=None),
        {
            "id": CID,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": MODEL,
            "choices": [],
            "usage": {
                "prompt_tokens": 9,
                "completion_tokens": 3,
                "total_tokens": 12,
                "completion_tokens_details": {"reasoning_tokens": 1},
            },
        },
        "[DONE]",
    ]
    for payload in events[:-1]:
        ChatCompletionChunk.model_validate(payload)
    last = ChatCompletionChunk.model_validate(events[-2])
    assert last.usage is not None and last.usage.total_tokens == 12


def test_stream_usage_chunk_when_provider_reported_none() -> None:
    cs = ChunkStream(completion_id=CID, model=MODEL, created=CREATED, include_usage=True)
    events = decode_events(cs.finish(None, None))
    assert events[0]["choices"][0]["finish_reason"] == "stop"
    assert events[1]["choices"] == [] and events[1]["usage"] is None
    assert events[2] == "[DONE]"
    for payload in events[:-1]:
        ChatCompletionChunk.model_validate(payload)


def test_stream_tool_calls() -> None:
    cs = ChunkStream(completion_id=CID, model=MODEL, created=CREATED, include_usage=False)
    stream = (
        cs.first()
        + cs.tool_call(
            0, {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        )
        + cs.tool_call(1, {"function": {"name": "g", "arguments": {"x": [1, 2]}}})
        + cs.finish(None, None)
    )
    events = decode_events(stream)
    assert events[1] == chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}"},
                }
            ]
        }
    )
    second = events[2]["choices"][0]["delta"]["tool_calls"][0]
    assert second["index"] == 1 and second["id"].startswith("call_")
    assert second["function"] == {"name": "g", "arguments": '{"x":[1,2]}'}
    assert events[3] == chunk({}, "tool_calls")
    assert events[4] == "[DONE]"
    for payload in events[:-1]:
        ChatCompletionChunk.model_validate(payload)


def test_stream_length_with_tool_calls_stays_length() -> None:
    cs = ChunkStream(completion_id=CID, model=MODEL, created=CREATED, include_usage=False)
    cs.tool_call(0, {"function": {"name": "f"}})
    assert decode_events(cs.finish("length", None))[0] == chunk({}, "length")


def test_sdk_sse_decoder_and_stream_accumulator_rebuild_the_completion() -> None:
    """The SDK's own SSE decoder and chunk accumulator read our stream end to end."""
    from openai._streaming import SSEDecoder
    from openai.lib.streaming.chat import ChatCompletionStreamState

    cs = ChunkStream(completion_id=CID, model=MODEL, created=CREATED, include_usage=True)
    pieces = [
        cs.first(),
        cs.text("Checking "),
        cs.text("now."),
        cs.tool_call(0, {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}),
        cs.finish(None, Usage(input_tokens=3, output_tokens=4)),
    ]
    # Feed the bytes in awkward slices, as a socket would.
    raw = b"".join(pieces)
    slices = [raw[i : i + 7] for i in range(0, len(raw), 7)]
    state = ChatCompletionStreamState()
    saw_done = False
    for sse in SSEDecoder().iter_bytes(iter(slices)):
        if sse.data == "[DONE]":
            saw_done = True
            continue
        state.handle_chunk(ChatCompletionChunk.model_validate(sse.json()))
    assert saw_done
    final = state.get_final_completion()
    assert final.id == CID and final.model == MODEL
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking now."
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert final.usage is not None and final.usage.total_tokens == 7
