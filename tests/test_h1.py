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
    RequestReader,
    ResponseReader,
    render_request,
)


def _feed(reader: ResponseReader | RequestReader, raw: bytes,
          splits: list[int] | None) -> bytearray:
    """Feed ``raw`` in pieces (cut at ``splits``, default byte by byte); the body read."""
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
    return body


def _read_all(raw: bytes, *, splits: list[int] | None = None, eof: bool = True,
              head_only: bool = False) -> tuple[ResponseReader, bytes]:
    """A response read from ``raw`` in pieces, then (``eof``) the peer's close."""
    reader = ResponseReader(head_only=head_only)
    body = _feed(reader, raw, splits)
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


# ------------------------------------------------------------ request reader


def _read_request(raw: bytes, *, splits: list[int] | None = None,
                  max_head: int = 16384) -> tuple[RequestReader, bytes]:
    reader = RequestReader(max_head)
    return reader, bytes(_feed(reader, raw, splits))


def test_request_head_and_length_body_byte_by_byte() -> None:
    raw = (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: edge\r\n"
           b"Authorization: Bearer  k  \r\nContent-Length: 2\r\n\r\n{}")
    reader, body = _read_request(raw)
    head = reader.head
    assert head is not None and reader.complete and body == b"{}"
    assert (head.method, head.target, head.http_version) == (
        "POST", "/v1/chat/completions?x=1", "1.1")
    assert ("authorization", "Bearer  k") in head.headers
    assert head.keep_alive and head.content_length == 2 and not head.expect_continue


def test_pipelined_request_bytes_are_left_over() -> None:
    reader = RequestReader()
    reader.receive_data(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHo")
    head = reader.read_head()
    assert head is not None and head.target == "/a" and reader.complete
    assert reader.leftover() == b"GET /b HTTP/1.1\r\nHo"


@pytest.mark.parametrize(
    ("raw", "keep_alive", "expect"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", False, False),
        (b"GET / HTTP/1.0\r\n\r\n", False, False),
        (b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
         True, True),
        (b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n", False, False),
    ],
)
def test_request_keep_alive_and_expect(raw: bytes, keep_alive: bool, expect: bool) -> None:
    reader = RequestReader()
    reader.receive_data(raw)
    head = reader.read_head()
    assert head is not None
    assert head.keep_alive is keep_alive and head.expect_continue is expect


@pytest.mark.parametrize(
    "raw",
    [
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
        b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n",
        b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",
        b"GET / HTTP/1.1\r\n Host: a\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +1\r\n\r\nx",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
    ],
)
def test_malformed_requests_raise_400(raw: bytes) -> None:
    with pytest.raises(H1ProtocolError) as info:
        _read_request(raw, splits=[])
    assert info.value.status_hint == 400


def test_request_head_over_the_limit_is_431() -> None:
    with pytest.raises(H1ProtocolError) as info:
        _read_request(b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 3000 + b"\r\n\r\n",
                      splits=[], max_head=2048)
    assert info.value.status_hint == 431


_METHODS = [b"GET", b"POST", b"G(T", b"", b"P OST"]
_TARGETS = [b"/v1/chat", b"/a?b=c&d", b"*", b"/a b", b"/\x7f", b"/\xc3\xa9"]
_VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 "]
_LINES = [
    b"Host: x", b"Host: y", b"Content-Length: 2", b"Content-Length: 0", b"Content-Length: abc",
    b"Content-Length: 2, 2", b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip",
    b"Transfer-Encoding: Chunked", b"Connection: close", b"X-A: a\x00b", b" folded",
    b"Bad Name: v", b"Expect: 100-continue", b"X-Empty:", b"X:  spaced  ", b"X-Tab:\tv\t",
    b"NoColon", b"X-Latin: caf\xe9", b"X-Ctl: a\x1bb",
]
_BODIES = [b"", b"{}", b"2\r\n{}\r\n0\r\n\r\n", b"2;e=1\r\n{}\r\n0\r\nT: 1\r\n\r\n",
           b"zz\r\n", b"2\r\n{}XX"]


def _h11_parse(raw: bytes) -> tuple[h11.Request, bytes] | None:
    """What h11 makes of ``raw`` (None when it refuses or needs more)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16384)
    conn.receive_data(raw)
    body = b""
    head: h11.Request | None = None
    try:
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, body
            else:
                return None
    except h11.RemoteProtocolError:
        return None


@settings(max_examples=600, deadline=None)
@given(
    method=st.sampled_from(_METHODS),
    target=st.sampled_from(_TARGETS),
    version=st.sampled_from(_VERSIONS),
    lines=st.lists(st.sampled_from(_LINES), max_size=6),
    body=st.sampled_from(_BODIES),
)
def test_request_reader_is_never_more_lenient_than_h11(
    method: bytes, target: bytes, version: bytes, lines: list[bytes], body: bytes
) -> None:
    raw = b"\r\n".join([method + b" " + target + b" " + version, *lines]) + b"\r\n\r\n" + body
    try:
        reader, got = _read_request(raw, splits=[])
        ours = (reader.head, got) if reader.complete else None
    except H1ProtocolError:
        ours = None
    theirs = _h11_parse(raw)
    if ours is None:
        return  # refusing (or still waiting) is always allowed: stricter is fine
    assert theirs is not None, f"we accepted what h11 refuses: {raw!r}"
    head, got = ours
    assert head is not None
    ref, ref_body = theirs
    assert head.method.encode() == ref.method and head.target.encode() == ref.target
    # (h11 lower-cases the value of Transfer-Encoding; the framing is the same)
    ours_headers = [
        (k.encode(), v.lower().encode() if k == "transfer-encoding" else v.encode("latin-1"))
        for k, v in head.headers
    ]
    assert ours_headers == list(ref.headers)
    assert got == ref_body


@pytest.mark.parametrize(
    "raw",
    [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: edge:8000\r\nContent-Type: application/json"
        b"\r\nAuthorization: Bearer sk-x\r\nContent-Length: 2\r\n\r\n{}",
        b"POST /v1/responses HTTP/1.1\r\nHost: e\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n",
        b"GET /v1/models HTTP/1.0\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nhost: e\r\nuser-agent: curl/8\r\naccept: */*\r\n\r\n",
    ],
)
def test_everyday_requests_parse_like_h11(raw: bytes) -> None:
    reader, body = _read_request(raw)
    theirs = _h11_parse(raw)
    assert theirs is not None and reader.head is not None and reader.complete
    ref, ref_body = theirs
    assert reader.head.method.encode() == ref.method and reader.head.target.encode() == ref.target
    assert body == ref_body


@pytest.mark.parametrize("line", [b"0x5", b"+5", b"5_0", b"-5", b" ", b"g", b"5 5"])
def test_chunk_size_lines_int_would_accept_are_refused(line: bytes) -> None:
    reader = ResponseReader()
    reader.receive_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + line + b"\r\nhello\r\n0\r\n\r\n")
    reader.read_head()
    with pytest.raises(H1ProtocolError):
        reader.read_body()


@pytest.mark.parametrize("line", [b"5", b"05", b"0005;ext=1", b"5 ", b"5\t;x"])
def test_chunk_size_lines_that_are_fine(line: bytes) -> None:
    reader = ResponseReader()
    reader.receive_data(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + line + b"\r\nhello\r\n0\r\n\r\n")
    reader.read_head()
    assert reader.read_body() == b"hello" and reader.complete


@pytest.mark.parametrize("value", ["\u00b32", "\u0662", "1\u00b9"])  # '³2', Arabic-Indic 2, '1¹'
def test_non_ascii_digits_are_not_a_content_length(value: str) -> None:
    raw_value = value.encode("latin-1", "replace") if all(ord(c) < 256 for c in value) else b"\xd9"
    with pytest.raises(H1ProtocolError):
        _read_request(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: " + raw_value + b"\r\n\r\n",
                      splits=[])
    with pytest.raises(H1ProtocolError):
        _read_all(b"HTTP/1.1 200 OK\r\nContent-Length: " + raw_value + b"\r\n\r\n", splits=[],
                  eof=False)
