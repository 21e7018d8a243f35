"""``anthropic_api/translating.py``: the responder that turns chat bytes into
Messages bytes, driven the way the relay's wire reader drives it (held
writes, no awaits) and the way the normalized paths do (awaited writes)."""

from __future__ import annotations

import json
from typing import Any

import h11

from iopd.edge.openai.anthropic_api.translating import Translating
from iopd.http.responder import Responder


class _Server:
    server_header = "iopd"
    closing = False


class _Sink:
    """A connection that takes every byte at once."""

    def __init__(self) -> None:
        self.data = b""
        self.torn = False
        self.server = _Server()
        self.unsent = False

    async def send_bytes(self, data: bytes, scope: Any) -> None:
        self.data += data

    def send_now(self, data: bytes) -> bool:
        self.data += data
        return True


def _translating() -> tuple[_Sink, Responder, Translating]:
    sink = _Sink()
    inner = Responder(sink, False, None)
    return sink, inner, Translating(inner, message_id="msg-1", model="coder", input_estimate=3)


def _response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Parse the bytes the caller got (a client's view, with h11)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/v1/messages", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    status, headers, body = 0, {}, b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage) or event is h11.NEED_DATA:
            return status, headers, body


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def test_held_stream_writes_translate_a_chat_stream_cut_anywhere() -> None:
    sink, inner, tr = _translating()
    chat = (
        _sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
        + _sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        + _sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 1}})
        + b"data: [DONE]\n\n"
    )
    tr.start_held(200, [("content-type", "text/event-stream"), ("x-upstream", "1")])
    for i in range(0, len(chat), 5):  # the reader's pieces, as they come
        assert tr.write_held(chat[i : i + 5])
    assert tr.end_held() and inner.finished
    assert tr.flush_nowait()
    assert not tr.write_held(b"late")  # after the end: refused, as the responder does
    status, headers, body = _response(sink.data)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["x-upstream"] == "1"
    names = [line[7:] for line in body.decode().splitlines() if line.startswith("event: ")]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


async def test_a_whole_completion_and_a_provider_error_become_messages_bodies() -> None:
    sink, _, tr = _translating()
    completion = {
        "choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 5},
    }
    tr.start_held(200, [("content-type", "application/json"), ("content-length", "999")])
    data = json.dumps(completion).encode()
    assert tr.write_held(data[:10]) and tr.write_held(data[10:])
    await tr.end()
    status, headers, body = _response(sink.data)
    message = json.loads(body)
    assert status == 200 and headers["content-type"] == "application/json"
    assert message["content"] == [{"type": "text", "text": "ok"}]
    assert message["stop_reason"] == "max_tokens" and message["model"] == "coder"

    sink, _, tr = _translating()
    await tr.start(400, [("content-type", "application/json")])
    await tr.write(b'{"error": {"message": "context too long", "type": "invalid_request_error"}}')
    await tr.end()
    status, _, body = _response(sink.data)
    assert status == 400
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "context too long"},
    }


async def test_a_native_answer_passes_through_untranslated() -> None:
    sink, _, tr = _translating()
    tr.translate = False  # (what upstream() sets for a Messages-native provider)
    native = b'{"type": "message", "content": []}'
    await tr.as_responder().send(200, [("content-type", "application/json")], native)
    assert _response(sink.data)[2] == native


async def test_the_normalized_whole_answer_is_sent_translated() -> None:
    sink, inner, tr = _translating()
    doc = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    await tr.send(200, [("content-type", "application/json")], json.dumps(doc).encode())
    assert inner.finished and tr.finished and tr.started
    message = json.loads(_response(sink.data)[2])
    assert message["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {}}]
    assert message["usage"] == {"input_tokens": 3, "output_tokens": 0}  # the estimate
