"""Property tests: whatever bytes arrive, ``wire/`` raises only ``WireError`` subclasses."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.wire_peers import SAMPLE_CHALLENGE, SAMPLE_PROOF
from wire.connection import Connection, Role
from wire.errors import RemoteProtocolError, WireError
from wire.framing import FrameDecoder, encode_frame
from wire.messages import (
    PROTOCOL_VERSION,
    Cancel,
    Credit,
    Hello,
    HelloAck,
    Message,
    NodeConfig,
    ProviderSpec,
    ProviderTunnelFrame,
    RunEvent,
    RunRequest,
    Usage,
)

SAMPLES: list[Message] = [
    Hello(protocol_version=PROTOCOL_VERSION, node_id="node-a", token="tok"),
    HelloAck(edge_id="e"),
    RunRequest(
        stream_id=1,
        provider_id="p",
        adapter="echo",
        target="m",
        messages=[{"role": "user", "content": "hi"}],
    ),
    RunEvent(stream_id=1, kind="text", text="hello"),
    RunEvent(stream_id=1, kind="complete", usage=Usage(input_tokens=1, output_tokens=2)),
    ProviderTunnelFrame(stream_id=1, kind="body", data=b"data: {}\n\n"),
    ProviderTunnelFrame(
        stream_id=1, kind="whole", status=200, data=b"{}", body_usage=Usage(input_tokens=1)
    ),
    NodeConfig(stream_id=1, version=1, providers=[ProviderSpec(id="x", type="echo")]),
    Cancel(stream_id=1, reason="r"),
    SAMPLE_CHALLENGE,
    SAMPLE_PROOF,
    Credit(stream_id=1, frames=3),
]
FRAMES = [encode_frame(m) for m in SAMPLES]


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(FRAMES)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "prefix"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[i] = draw(st.integers(0, 255))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[i]
        elif op == "truncate":
            data = data[:i]
        elif op == "prefix" and len(data) >= 4:
            data[0:4] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big")
    return bytes(data)


def _feed_decoder(data: bytes, chunk: int) -> None:
    dec = FrameDecoder(max_frame_bytes=4096)
    try:
        for i in range(0, len(data), chunk):
            dec.feed(data[i : i + chunk])
            assert dec.buffered < 4 + 4096
        dec.eof()
    except WireError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512), st.integers(1, 64))
def test_random_bytes_only_wire_errors(data: bytes, chunk: int) -> None:
    _feed_decoder(data, chunk)


@settings(max_examples=1000, deadline=None)
@given(mutated_frames(), st.integers(1, 64))
def test_mutated_frames_only_wire_errors(data: bytes, chunk: int) -> None:
    _feed_decoder(data, chunk)


def _open_pair() -> tuple[Connection, Connection]:
    edge, node = Connection(Role.EDGE), Connection(Role.NODE)
    edge.receive_data(node.send(SAMPLES[0]))
    node.receive_data(edge.send(SAMPLE_CHALLENGE))
    edge.receive_data(node.send(SAMPLE_PROOF))
    node.receive_data(edge.send(HelloAck(edge_id="e")))
    node.receive_data(edge.send(SAMPLES[2]))  # stream 1 open
    return edge, node


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(mutated_frames(), min_size=1, max_size=4), st.sampled_from(["fresh", "edge", "node"])
)
def test_connection_rejects_only_with_remote_errors(frames: list[bytes], which: str) -> None:
    if which == "fresh":
        conn = Connection(Role.EDGE)
    else:
        edge, node = _open_pair()
        conn = edge if which == "edge" else node
    try:
        for frame in frames:
            conn.receive_data(frame)
        conn.receive_eof()
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(max_size=40), min_size=1, max_size=8),
    st.lists(st.integers(0, 400), max_size=10),
)
def test_any_split_round_trips(texts: list[str], cuts: list[int]) -> None:
    msgs = [RunEvent(stream_id=i + 1, kind="text", text=t) for i, t in enumerate(texts)]
    data = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    out: list[Message] = []
    prev = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts) + [len(data)]:
        out += dec.feed(data[prev:cut])
        prev = cut
    assert out == msgs
