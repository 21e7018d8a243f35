"""The provider client's sans-IO HTTP/1.1 layer (``iopd.http.h1``).

Parsing is checked byte by byte and at random split points against the
bodies that were framed, every malformed case raises ``H1ProtocolError``,
and request rendering refuses header injection.
"""

from __future__ import annotations

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iopd.http.h1 import (
    MAX_HEAD_BYTES,
    H1ProtocolError,
    ResponseReader,
    render_request,
)


def _read_all(raw: bytes, *, splits: list[int] | None = None, eof: bool = True,
              head_only: bool = False) -> tuple[ResponseReader, bytes]:
    """Feed ``raw`` in pieces (cut at ``splits``, default byte by byte); return reader, body."""
    reader = ResponseReader(head_only=head_only)
    cuts = sorted(set(splits)) if splits is not None else list(range(1, len(raw)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    body = bytearray()
    for piece in pieces:
        reader.receive_data(piece)
        if reader.head is None and reader.read_head() is None:
            continue
        body += reader.read_body()
    if reader.head is not None and not reader.complete:
        body += reader.read_body()  # raises an error found after good bytes
    if eof and not reader.complete:
        reader.receive_eof()
        if reader.head is None:
            reader.read_head()
        body += reader.read_body()
    return reader, bytes(body)


def _chunked(body: bytes, sizes: list[int], *, ext: bool = False, trailer: bool = False) -> bytes:
    out = bytearray(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
    pos = 0
    for size in sizes:
        piece = body[pos:pos + size]
        if not piece:
            break
        out += b"%x%s\r\n%s\r\n" % (len(piece), b";name=v" if ext else b"", piece)
        pos += len(piece)
    if pos < len(body):
        out += b"%x\r\n%s\r\n" % (len(body) - pos, body[pos:])
    out += b"0\r\n" + (b"X-Trailer: 1\r\n" if trailer else b"") + b"\r\n"
    return bytes(out)


# ----------------------------------------------------------------- framing

def test_content_length_body_byte_by_byte() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\": true}"
    reader, body = _read_all(raw, eof=False)
    assert reader.head is not None and reader.head.status == 200
    assert ("content-type", "application/json") in reader.head.headers
    assert body == b'{"a": true}'
    assert reader.complete and reader.keep_alive and reader.reusable


def test_chunked_body_with_extensions_and_trailers_byte_by_byte() -> None:
    payload = b"data: {\"x\": 1}\n\n" * 5
    raw = _chunked(payload, [3, 7, 16, 1], ext=True, trailer=True)
    reader, body = _read_all(raw, eof=False)
    assert body == payload
    assert reader.complete and reader.reusable


def test_buffered_chunks_come_out_as_one_piece() -> None:
    payload = b"data: x\n\n" * 19
    raw = _chunked(payload, [9] * 19)
    reader = ResponseReader()
    reader.receive_data(raw)
    assert reader.read_head() is not None
    assert reader.read_body() == payload  # all of it, at once
    assert reader.complete


def test_close_delimited_body_ends_at_eof_and_is_not_reusable() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello world"
    reader, body = _read_all(raw)
    assert body == b"hello world"
    assert reader.complete and not reader.keep_alive and not reader.reusable


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_statuses(status: int) -> None:
    reader, body = _read_all(b"HTTP/1.1 %d X\r\nContent-Length: 5\r\n\r\n" % status, eof=False)
    assert body == b"" and reader.complete and reader.reusable


def test_head_request_has_no_body() -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
    reader, body = _read_all(raw, eof=False, head_only=True)
    assert body == b"" and reader.complete


def test_informational_heads_are_skipped() -> None:
    raw = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
           b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
    reader, body = _read_all(raw, eof=False)
    assert reader.head is not None and reader.head.status == 201 and body == b"ok"


@pytest.mark.parametrize(
    ("head", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n", False),
        # both framings: chunked wins, the connection is never reused
        (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
         False),
    ],
)
def test_keep_alive_decision(head: bytes, keep_alive: bool) -> None:
    reader, _ = _read_all(head, eof=False)
    assert reader.complete and reader.keep_alive is keep_alive


def test_bytes_after_the_response_make_it_not_reusable() -> None:
    reader = ResponseReader()
    reader.receive_data(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokJUNK")
    reader.read_head()
    assert reader.read_body() == b"ok"
    assert reader.complete and not reader.reusable


def test_lf_only_line_endings_are_accepted() -> None:
    reader, body = _read_all(b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", eof=False)
    assert body == b"ok" and reader.complete


def test_good_bytes_before_a_malformed_chunk_come_first() -> None:
    reader = ResponseReader()
    reader.receive_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        b"5\r\nhello\r\nZZ\r\n")
    reader.read_head()
    assert reader.read_body() == b"hello"
    with pytest.raises(H1ProtocolError):
        reader.read_body()


# --------------------------------------------------------------- malformed

@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nNoColon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\r\n folded\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n11111111111111111\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nbad trailer\r\n\r\n",
    ],
)
def test_malformed_responses_raise(raw: bytes) -> None:
    with pytest.raises(H1ProtocolError):
        _read_all(raw, splits=[], eof=False)


@pytest.mark.parametrize(
    "raw",
    [
        b"",  # closed without a response
        b"HTTP/1.1 200 OK\r\nContent-Le",  # inside the head
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
    ],
)
def test_eof_before_the_end_raises(raw: bytes) -> None:
    with pytest.raises(H1ProtocolError):
        _read_all(raw, splits=[], eof=True)


def test_head_size_is_bounded() -> None:
    reader = ResponseReader()
    reader.receive_data(b"HTTP/1.1 200 OK\r\nX: " + b"a" * (MAX_HEAD_BYTES + 10))
    with pytest.raises(H1ProtocolError, match="too large"):
        reader.read_head()


def test_chunk_size_line_is_bounded() -> None:
    reader = ResponseReader()
    reader.receive_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"x" * 9000)
    reader.read_head()
    with pytest.raises(H1ProtocolError, match="too long"):
        reader.read_body()


# --------------------------------------------------------------- rendering

def test_render_request_matches_what_h11_parses() -> None:
    data = render_request(
        "POST", "/v1/chat/completions?x=1",
        [("Host", "example:8000"), ("Authorization", "Bearer k"), ("Content-Length", "2")],
        b"{}",
    )
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    req = server.next_event()
    assert isinstance(req, h11.Request)
    assert req.method == b"POST" and req.target == b"/v1/chat/completions?x=1"
    assert (b"authorization", b"Bearer k") in list(req.headers)
    body = server.next_event()
    assert isinstance(body, h11.Data) and body.data == b"{}"
    assert isinstance(server.next_event(), h11.EndOfMessage)


@pytest.mark.parametrize(
    ("method", "target", "headers"),
    [
        ("PO ST", "/", []),
        ("GET", "/a b", []),
        ("GET", "/\r\nX: y", []),
        ("GET", "/", [("X-Inject", "a\r\nEvil: 1")]),
        ("GET", "/", [("X-Inject", "a\nb")]),
        ("GET", "/", [("Bad Name", "v")]),
        ("GET", "/", [("X", "\u20ac")]),  # not latin-1
    ],
)
def test_render_request_refuses_injection(
    method: str, target: str, headers: list[tuple[str, str]]
) -> None:
    with pytest.raises(H1ProtocolError):
        render_request(method, target, [("Host", "h"), *headers], b"")


# ---------------------------------------------------------------- property

@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=600),
    sizes=st.lists(st.integers(min_value=1, max_value=97), max_size=12),
    splits=st.lists(st.integers(min_value=1, max_value=900), max_size=12),
    ext=st.booleans(),
    trailer=st.booleans(),
)
def test_chunked_round_trip_at_any_split(
    body: bytes, sizes: list[int], splits: list[int], ext: bool, trailer: bool
) -> None:
    raw = _chunked(body, sizes, ext=ext, trailer=trailer)
    reader, got = _read_all(raw, splits=[s for s in splits if s < len(raw)], eof=False)
    assert got == body
    assert reader.complete and reader.reusable


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400))
def test_garbage_never_raises_anything_but_protocol_errors(data: bytes) -> None:
    reader = ResponseReader()
    reader.receive_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + data)
    reader.receive_eof()
    try:
        reader.read_head()
        while not reader.complete:
            reader.read_body()
    except H1ProtocolError:
        pass
