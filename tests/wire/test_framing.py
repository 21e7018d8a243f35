"""Byte-level tests of wire/framing.py: split everywhere, caps, malformed input."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from wire.errors import FrameTooLarge, LocalProtocolError, MalformedFrame, RemoteProtocolError
from wire.framing import MAX_FRAME_BYTES, FrameDecoder, encode_frame
from wire.messages import (
    Cancel,
    Hello,
    Message,
    NodeConfig,
    ProviderSpec,
    ProviderTunnelFrame,
    RunEvent,
    Usage,
)

SAMPLES: list[Message] = [
    Hello(protocol_version=1, node_id="node-a", token="secret"),
    RunEvent(stream_id=7, kind="text", text="hello wörld ✓"),
    RunEvent(stream_id=7, kind="complete", usage=Usage(input_tokens=3, output_tokens=2)),
    ProviderTunnelFrame(stream_id=9, kind="body", data=bytes(range(256)) * 3),
    NodeConfig(stream_id=1, version=2, providers=[ProviderSpec(id="e", type="echo")]),
    Cancel(stream_id=3, reason="client gone"),
]


def _stream() -> bytes:
    return b"".join(encode_frame(m) for m in SAMPLES)


def test_frame_layout_is_length_prefix_then_msgpack() -> None:
    frame = encode_frame(SAMPLES[1])
    size = int.from_bytes(frame[:4], "big")
    assert size == len(frame) - 4
    assert msgspec.msgpack.decode(frame[4:])["t"] == "RunEvent"


def test_whole_stream_in_one_feed() -> None:
    assert FrameDecoder().feed(_stream()) == SAMPLES


def test_byte_at_a_time() -> None:
    dec = FrameDecoder()
    out = []
    for i in range(len(data := _stream())):
        out += dec.feed(data[i : i + 1])
    assert out == SAMPLES
    assert dec.buffered == 0


def test_split_at_every_position() -> None:
    data = _stream()
    for cut in range(len(data) + 1):
        dec = FrameDecoder()
        assert dec.feed(data[:cut]) + dec.feed(data[cut:]) == SAMPLES, cut


def test_feed_accepts_memoryview_and_bytearray() -> None:
    data = _stream()
    dec = FrameDecoder()
    assert dec.feed(memoryview(data)[:10]) + dec.feed(bytearray(data[10:])) == SAMPLES


def test_oversized_prefix_rejected_before_payload() -> None:
    dec = FrameDecoder(max_frame_bytes=1024)
    with pytest.raises(FrameTooLarge) as info:
        dec.feed((1025).to_bytes(4, "big"))  # only the prefix: nothing else buffered
    assert "1025" in info.value.reason
    assert dec.buffered == 0
    with pytest.raises(FrameTooLarge):  # stays broken
        dec.feed(b"x")


def test_default_cap_is_16_mib() -> None:
    assert MAX_FRAME_BYTES == 16 * 1024 * 1024
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    # exactly at the cap is accepted as a length (waits for payload)
    dec = FrameDecoder()
    assert dec.feed(MAX_FRAME_BYTES.to_bytes(4, "big") + b"\x00" * 10) == []


def test_buffer_stays_below_one_frame() -> None:
    dec = FrameDecoder(max_frame_bytes=100)
    frame = encode_frame(RunEvent(stream_id=1, kind="text", text="x" * 50))
    for _ in range(20):
        dec.feed(frame + frame[:7])
        assert dec.buffered < 4 + 100
        dec.feed(frame[7:])
        assert dec.buffered == 0


def test_zero_length_frame_is_malformed() -> None:
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(b"\x00\x00\x00\x00")


def test_garbage_is_malformed() -> None:
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")


def test_unknown_tag_is_malformed() -> None:
    body = msgspec.msgpack.encode({"t": "Bogus", "stream_id": 1})
    with pytest.raises(MalformedFrame) as info:
        FrameDecoder().feed(len(body).to_bytes(4, "big") + body)
    assert "Bogus" not in info.value.reason  # peer data is not echoed


def test_invalid_utf8_is_malformed() -> None:
    body = bytearray(msgspec.msgpack.encode(Cancel(stream_id=1, reason="ab")))
    body[body.index(b"ab") : body.index(b"ab") + 2] = b"\xff\xfe"
    with pytest.raises(MalformedFrame) as info:
        FrameDecoder().feed(len(body).to_bytes(4, "big") + bytes(body))
    assert "UTF-8" in info.value.reason


def test_wrong_field_type_is_malformed() -> None:
    body = msgspec.msgpack.encode({"t": "Cancel", "stream_id": "one"})
    with pytest.raises(MalformedFrame):
        FrameDecoder().feed(len(body).to_bytes(4, "big") + body)


def test_truncated_frame_then_eof() -> None:
    dec = FrameDecoder()
    frame = encode_frame(SAMPLES[0])
    assert dec.feed(frame[:-1]) == []
    with pytest.raises(MalformedFrame) as info:
        dec.eof()
    assert "closed inside a frame" in info.value.reason


def test_clean_eof_between_frames() -> None:
    dec = FrameDecoder()
    dec.feed(encode_frame(SAMPLES[0]))
    dec.eof()  # nothing pending: no error


def test_errors_are_remote_protocol_errors() -> None:
    assert issubclass(FrameTooLarge, RemoteProtocolError)
    assert issubclass(MalformedFrame, RemoteProtocolError)


def test_encode_over_cap_is_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(RunEvent(stream_id=1, kind="text", text="x" * 200), max_frame_bytes=100)


def test_wire_never_imports_trio() -> None:
    code = (
        "import sys, wire, wire.messages, wire.framing, wire.connection, wire.errors; "
        "assert 'trio' not in sys.modules, 'trio imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("first_bytes", "reason"),
    [
        (
            b"HTTP/1.1 408 Request Timeout\r\n",
            "the peer answered in HTTP: this is an HTTP server, not an iopd wire listener",
        ),
        (
            b"GET / HTTP/1.1\r\n",
            "the peer sent an HTTP request: this is an HTTP client, not an iopd wire peer",
        ),
        (
            b"POST /v1/chat/completions HTTP/1.1\r\n",
            "the peer sent an HTTP request: this is an HTTP client, not an iopd wire peer",
        ),
        (b"\x7f\x00\x00\x00", "frame length 2130706432 exceeds the 16777216-byte limit"),
    ],
)
def test_http_bytes_are_named_not_read_as_a_length(first_bytes: bytes, reason: str) -> None:
    with pytest.raises(FrameTooLarge) as info:
        FrameDecoder().feed(first_bytes)
    assert info.value.reason == reason
