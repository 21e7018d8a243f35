"""``StreamEnd``: a relayed stream's terminal event, split anywhere, never in text."""

from __future__ import annotations

import json

import pytest

from iopd.edge.openai.outgoing.stream_end import StreamEnd

TERMINALS = [
    b'data: {"choices":[]}\n\ndata: [DONE]\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n',
    b'data: {"type": "response.incomplete", "response": {}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    b'{"model":"m","done":true,"eval_count":3}\n',
    b'{"model": "m", "done": true}\n',
]


@pytest.mark.parametrize("body", TERMINALS)
def test_terminal_event_seen_however_it_is_split(body: bytes) -> None:
    for cut in range(1, len(body)):
        end = StreamEnd()
        end.feed(body[:cut])
        assert end.feed(body[cut:]) and end.seen


def test_text_and_other_events_are_not_the_end() -> None:
    end = StreamEnd()
    text = 'the model wrote "type":"response.completed" and "done":true and data: [DONE]'
    for event in (
        b'event: response.output_text.delta\ndata: '
        + json.dumps({"type": "response.output_text.delta", "delta": text}).encode()
        + b"\n\n",
        b'data: {"type":"response.created","response":{"status":"in_progress"}}\n\n',
        b'{"model":"m","done":false,"message":{"content":"x"}}\n',
        b"",
    ):
        assert not end.feed(event)
    assert not end.seen
