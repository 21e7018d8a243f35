"""Sans-IO HTTP/1.1: the provider client's requests and responses, the edge's requests.

Why not h11: the edge parses every request and the node relays every token of
every stream, and h11 spends most of its time on generality neither needs.
Measured on these machines (warm), h11 took ~37 µs to parse a request head,
~30 µs to render a request, ~26 µs to parse a response head and ~5 µs per SSE
chunk of a chunked body; on the cold first-chunk path of a streamed reply that
was ~300 µs across edge and node.  What is needed is exactly: request and
response heads parsed strictly, bodies de-framed (``Content-Length``,
``chunked``, or until close for responses), requests rendered from checked
parts.  That is what this module does, in a few regexes and slices, and
nothing else (no upgrades, no HTTP/1.0 keep-alive).

Strictness on the edge's public side: whatever ``RequestReader`` accepts, h11
and llhttp both accept with the same framing (method, target, headers and
where the body ends), so a front end built on either cannot disagree with
iopd about where a request ends (request smuggling).  Head and chunk lines end
in exactly CRLF; values are stripped of SP/HTAB only, on bytes; one framing;
token methods and names; no obsolete line folding, no control characters.
``tests/http/test_h1.py`` checks it against both on generated requests; the one
deliberate leniency (empty lines before a request line) is listed in
docs/reliability.md.  Responses (from providers) may still end head lines
in a bare LF, as h11 allows.

Limits: a response head (status line and headers, 1xx heads included) is at
most ``MAX_HEAD_BYTES``, a request head at most the reader's
``max_head_bytes``; a chunk-size line, and a whole trailer section, at most
``MAX_LINE_BYTES``.  A head arriving in pieces is scanned once, not from its
start on every piece.  Anything malformed raises :class:`H1ProtocolError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Literal

#: Largest response head accepted (status line and headers).
MAX_HEAD_BYTES = 64 * 1024
#: Largest chunk-size line (with extensions) and largest trailer section.
MAX_LINE_BYTES = 8 * 1024

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_METHOD_RE = re.compile(_TOKEN)
_TOKEN_STR_RE = re.compile(_TOKEN.decode())
_HEADER_NAME_RE = re.compile(_TOKEN)
_STATUS_LINES = {int(s): f"HTTP/1.1 {int(s)} {s.phrase}" for s in HTTPStatus}
# Field values: visible characters, obs-text, space and tab; no other controls.
_BAD_VALUE_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_TARGET_RE = re.compile(r"[\x00-\x20\x7f]")
_RESPONSE_HEAD_END_RE = re.compile(rb"\n\r?\n")
# A CR not followed by LF, or an LF without its CR: a request head line that
# does not end in exactly CRLF (found early, before the head is complete).
_BAD_EOL_RE = re.compile(rb"\r[^\n]|(?<!\r)\n")
_REQUEST_LINE_RE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) HTTP/1\.([01])")
_STATUS_LINE_RE = re.compile(rb"HTTP/1\.([0-9]) ([0-9]{3})(?: [^\x00-\x08\x0a-\x1f\x7f]*)?")
# The value is stripped of SP/HTAB afterwards, with bytes.strip: a lazy value
# group followed by ``[ \t]*`` backtracks quadratically on a run of spaces.
_HEADER_LINE_RE = re.compile(rb"(" + _TOKEN + rb"):([^\x00-\x08\x0a-\x1f\x7f]*)")
_OWS = b" \t"
_HEX_DIGITS = b"0123456789abcdefABCDEF"
# chunk-size [ chunk-ext ] with no whitespace anywhere (llhttp refuses BWS):
# ``;name`` or ``;name=token`` or ``;name="quoted"``; no CR or LF inside.
_QUOTED_STRING = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_CHUNK_SIZE_RE = re.compile(
    rb"([0-9A-Fa-f]{1,16})(?:;" + _TOKEN + rb"(?:=(?:" + _TOKEN + rb"|" + _QUOTED_STRING + rb"))?)*"
)
# Request targets (RFC 9112 §3.2): origin-form, absolute-form with a plain
# host, and ``*`` for OPTIONS only.  Authority-form belongs to CONNECT (405).
_ABSOLUTE_FORM_RE = re.compile(
    rb"[A-Za-z]+://(?:[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{0,5})?(?:/[\x21-\x7e]*)?"
)
#: Methods a request may carry (RFC 9110 §9 and PATCH).  Any other token is
#: answered 501 (RFC 9110 §15.6.2), CONNECT 405: iopd is no tunnel.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH"})
#: Empty lines (CRLF) ignored before a request line (RFC 9112 §2.2); more is a 400.
MAX_EMPTY_LINES = 8
#: Header fields that may not appear in a trailer section (they frame the message).
_FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding"})


class H1ProtocolError(Exception):
    """The peer broke HTTP/1.1 (or we were asked to send something illegal).

    ``status_hint``: the status a server answers it with: 400, 431 for a head
    too large, 405 for CONNECT, 501 for a method or transfer-coding iopd does
    not implement.
    """

    def __init__(self, message: str, *, status_hint: int = 400) -> None:
        super().__init__(message)
        self.status_hint = status_hint


def render_response_head(status: int, headers: Iterable[tuple[str, str]]) -> bytes:
    """Status line and headers of a response, checked like a request's headers
    (so no relayed header can split the response)."""
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise H1ProtocolError(f"invalid status code {status}")
        line = f"HTTP/1.1 {status} "
    return _render_head(line, headers)


def _render_head(first_line: str, headers: Iterable[tuple[str, str]]) -> bytes:
    """``first_line`` and the header lines, each name a token and each value free
    of control characters (CR, LF, NUL ...), then the blank line."""
    lines = [first_line]
    for name, value in headers:
        if not _HEADER_NAME_RE.fullmatch(name.encode("latin-1", "replace")):
            raise H1ProtocolError(f"illegal header name {name[:64]!r}")
        if _BAD_VALUE_RE.search(value):
            raise H1ProtocolError(f"illegal value in header {name[:64]!r}")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    try:
        return "\r\n".join(lines).encode("latin-1")
    except UnicodeEncodeError:
        raise H1ProtocolError("header value is not latin-1") from None


_Framing = Literal["none", "length", "chunked", "close"]
_ChunkState = Literal["size", "data", "crlf", "trailers"]


class _BodyReader:
    """Buffer, framing and body de-framing shared by the request and response readers."""

    #: A malformed chunk found after good bytes is raised by the next
    #: ``read_body`` (a relayed stream gets everything that was good), not at once.
    _good_bytes_first = True

    __slots__ = (
        "_buf",
        "_eof",
        "complete",
        "received_any",
        "_framing",
        "_remaining",
        "_chunk_state",
        "_trailer_bytes",
        "_error",
    )

    def __init__(self) -> None:
        self._buf = bytearray()
        self._eof = False
        #: True once the whole body was read.
        self.complete = False
        #: True once any byte arrived (a reused client connection that fails
        #: before that may be retried).
        self.received_any = False
        self._framing: _Framing = "none"
        self._remaining = 0
        self._chunk_state: _ChunkState = "size"
        self._trailer_bytes = 0
        # A malformed body found after good bytes: those are returned first,
        # the error is raised by the next ``read_body``.
        self._error: H1ProtocolError | None = None

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            self._buf += data
            self.received_any = True

    def receive_eof(self) -> None:
        self._eof = True

    @property
    def buffered(self) -> bool:
        """Bytes are buffered that were not parsed yet."""
        return bool(self._buf)

    def read_body(self) -> bytes:
        """Body bytes available now (de-chunked), ``b""`` when none; sets ``complete``.

        Raises :class:`H1ProtocolError` on a malformed body, or when the
        connection closed before the body was complete.
        """
        if self._error is not None:
            raise self._error
        if self.complete:
            return b""
        framing = self._framing
        buf = self._buf
        if framing == "length":
            n = min(len(buf), self._remaining)
            data = bytes(buf[:n])
            del buf[:n]
            self._remaining -= n
            if self._remaining == 0:
                self.complete = True
            elif self._eof and not data:
                raise H1ProtocolError("connection closed before the end of the body")
            return data
        if framing == "close":
            data = bytes(buf)
            buf.clear()
            if self._eof:
                self.complete = True
            return data
        data = self._read_chunks()
        if not self.complete and self._eof and not data:
            raise H1ProtocolError("connection closed before the end of the chunked body")
        return data

    def _read_chunks(self) -> bytes:
        buf = self._buf
        pos = 0
        size = len(buf)
        parts: list[bytes | bytearray] = []
        state = self._chunk_state
        try:
            if state == "size":
                # Fast path: whole chunks (size line, data, CRLF) already
                # buffered, one step each: an SSE burst is many of them.
                while True:
                    nl = buf.find(b"\n", pos, pos + MAX_LINE_BYTES)
                    if nl < 0:
                        break
                    n = _chunk_size(buf, pos, nl)
                    data_end = nl + 1 + n
                    if n == 0 or data_end + 2 > size:
                        break  # the last chunk, or one not all here: the steps below
                    if buf[data_end] != 0x0D or buf[data_end + 1] != 0x0A:
                        raise H1ProtocolError("missing CRLF after chunk data")
                    parts.append(buf[nl + 1 : data_end])
                    pos = data_end + 2
            while pos < size:
                if state == "data":
                    n = min(size - pos, self._remaining)
                    parts.append(bytes(buf[pos : pos + n]))
                    pos += n
                    self._remaining -= n
                    if self._remaining == 0:
                        state = "crlf"
                elif state == "size":
                    nl = buf.find(b"\n", pos, pos + MAX_LINE_BYTES)
                    if nl < 0:
                        if size - pos >= MAX_LINE_BYTES:
                            raise H1ProtocolError("chunk size line too long")
                        break
                    self._remaining = _chunk_size(buf, pos, nl)
                    pos = nl + 1
                    state = "data" if self._remaining else "trailers"
                elif state == "crlf":
                    if size - pos < 2:
                        if buf[pos] != 0x0D:
                            raise H1ProtocolError("missing CRLF after chunk data")
                        break
                    if buf[pos] != 0x0D or buf[pos + 1] != 0x0A:
                        raise H1ProtocolError("missing CRLF after chunk data")
                    pos += 2
                    state = "size"
                else:  # trailers: header lines up to an empty line, discarded
                    room = MAX_LINE_BYTES - self._trailer_bytes  # the whole section
                    nl = buf.find(b"\n", pos, pos + room)
                    if nl < 0:
                        if size - pos >= room:
                            raise H1ProtocolError("trailer section too long")
                        break
                    self._trailer_bytes += nl + 1 - pos
                    if nl == pos or buf[nl - 1] != 0x0D:
                        raise H1ProtocolError("trailer line does not end in CRLF")
                    line = bytes(buf[pos : nl - 1])
                    pos = nl + 1
                    if not line:
                        self.complete = True
                        break
                    _check_trailer_line(line)
        except H1ProtocolError as exc:
            if not parts or not self._good_bytes_first:
                raise
            self._error = exc
        finally:
            self._chunk_state = state
            del buf[:pos]
        if not parts:
            return b""
        return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


@dataclass(slots=True)
class RequestHead:
    """A request head.  Header names are lower-case."""

    method: str
    target: str
    http_version: str  # "1.1" or "1.0"
    headers: list[tuple[str, str]]
    #: The client allows another request on this connection (HTTP/1.1, no ``close``).
    keep_alive: bool
    #: ``Expect: 100-continue`` on HTTP/1.1.
    expect_continue: bool
    #: The declared ``Content-Length`` (None when chunked or absent).
    content_length: int | None


class RequestReader(_BodyReader):
    """Reads one request (the server side): a strict head parser and the body.

    The rule (docs/reliability.md, "Parser strictness"): whatever this reader
    accepts, h11 and llhttp both accept with the same framing, so no front end
    built on either can see a different request boundary than iopd does.
    Every head line ends in exactly CRLF; values are stripped of SP/HTAB only;
    exactly one Host on HTTP/1.1; a single ``Content-Length`` of ASCII digits
    or ``Transfer-Encoding: chunked`` (not both); token methods and header
    names; origin-form, absolute-form or (OPTIONS) ``*`` targets; no obsolete
    line folding, no control characters.  Up to ``MAX_EMPTY_LINES`` CRLFs
    before the request line are skipped (the one deliberate leniency).

    Status hints: 431 for a head over ``max_head_bytes``; 405 for CONNECT;
    501 for a method outside ``KNOWN_METHODS`` or a transfer-coding other
    than chunked; 400 for everything else.
    """

    __slots__ = ("_empty_lines", "_max_head", "_scanned", "head")

    # The server buffers a request's whole body: an error is raised at once,
    # or it would wait for bytes the client need never send (a 408, not a 400).
    _good_bytes_first = False

    def __init__(self, max_head_bytes: int = MAX_HEAD_BYTES) -> None:
        super().__init__()
        self._max_head = max_head_bytes
        self._scanned = 0  # no head end in buf[:_scanned]: never rescanned
        self._empty_lines = 0
        self.head: RequestHead | None = None

    def leftover(self) -> bytes:
        """Bytes received after this request (the start of a pipelined next one)."""
        return bytes(self._buf)

    def read_head(self) -> RequestHead | None:
        """The request head, or None while it is incomplete (or the peer closed first).

        Each call scans only the bytes that arrived since the last one (plus
        the three that may start the CRLFCRLF), so a head sent byte by byte
        costs linear time.
        """
        if self.head is not None:
            return self.head
        buf = self._buf
        if buf and buf[0] == 0x0D and not self._scanned:
            self._skip_empty_lines()
        limit = self._max_head
        start = self._scanned
        end = buf.find(b"\r\n\r\n", start, limit + 4)
        if end < 0:
            if len(buf) >= limit + 4:
                raise H1ProtocolError("request head too large", status_hint=431)
            if _BAD_EOL_RE.search(buf, max(0, start - 1)) is not None:
                raise H1ProtocolError("a line of the request head does not end in CRLF")
            if self._eof and buf:
                raise H1ProtocolError("connection closed inside the request head")
            self._scanned = max(0, len(buf) - 3)
            return None
        raw = bytes(buf[:end])
        del buf[: end + 4]
        self.head = head = self._parse(raw)
        return head

    def _skip_empty_lines(self) -> None:
        """Drop the CRLFs before a request line (RFC 9112 §2.2), a few at most."""
        buf = self._buf
        n = 0
        while buf.startswith(b"\r\n", n):
            n += 2
        if n:
            del buf[:n]
            self._empty_lines += n // 2
            if self._empty_lines > MAX_EMPTY_LINES:
                raise H1ProtocolError("too many empty lines before the request line")

    def _parse(self, raw: bytes) -> RequestHead:
        lines = raw.split(b"\r\n")
        match = _REQUEST_LINE_RE.fullmatch(lines[0])
        if match is None:
            raise H1ProtocolError(f"invalid request line {lines[0][:64]!r}")
        method = match.group(1).decode("ascii")
        target = match.group(2)
        _check_method_and_target(method, target)
        http_version = "1.1" if match.group(3) == b"1" else "1.0"
        headers = _parse_headers(lines)
        hosts = 0
        connection: list[str] = []
        codings: list[str] = []
        lengths: list[str] = []
        expect_continue = False
        upgrade = False
        for name, value in headers:
            if name == "host":
                hosts += 1
            elif name == "content-length":
                lengths.append(value)
            elif name == "transfer-encoding":
                codings.append(value)
            elif name == "connection":
                connection += [t.strip(" \t").lower() for t in value.split(",")]
            elif name == "expect" and value.lower() == "100-continue":
                expect_continue = http_version == "1.1"
            elif name == "upgrade":
                upgrade = True
        if hosts > 1 or (hosts == 0 and http_version == "1.1"):
            raise H1ProtocolError("a request needs exactly one Host header")
        content_length: int | None = None
        if codings:
            _check_request_codings(codings, raw, lines)
            if lengths:
                raise H1ProtocolError("both Content-Length and Transfer-Encoding")
            self._framing = "chunked"
        elif lengths:
            value = lengths[0]
            if len(lengths) > 1 or not _is_decimal(value) or len(value) > 18:
                raise H1ProtocolError("invalid Content-Length")
            content_length = int(value)
            self._framing = "length"
            self._remaining = content_length
            self.complete = content_length == 0
        else:
            self.complete = True  # a request without framing headers has no body
        if upgrade and not self.complete:
            # llhttp ends such a request at its head (the body is tunnel data),
            # h11 reads the body: no framing both agree on.
            raise H1ProtocolError("a request with Upgrade cannot have a body")
        return RequestHead(
            method=method,
            target=target.decode("ascii"),
            http_version=http_version,
            headers=headers,
            # After a request naming an Upgrade, a front end may treat the
            # connection as a tunnel (llhttp stops parsing there): never read
            # another request from it.
            keep_alive=http_version == "1.1" and "close" not in connection and not upgrade,
            expect_continue=expect_continue,
            content_length=content_length,
        )


def _check_method_and_target(method: str, target: bytes) -> None:
    """CONNECT is 405, a method iopd does not know 501, a target of the wrong form 400."""
    if method not in KNOWN_METHODS:
        if method == "CONNECT":
            raise H1ProtocolError("CONNECT is not supported: iopd is not a proxy", status_hint=405)
        raise H1ProtocolError(f"method {method[:32]!r} is not implemented", status_hint=501)
    if target[0] == 0x2F:  # "/": origin-form, the usual case
        return
    if target == b"*":
        if method == "OPTIONS":
            return
        raise H1ProtocolError("the target * is only for OPTIONS")
    if _ABSOLUTE_FORM_RE.fullmatch(target) is None:
        raise H1ProtocolError(f"invalid request target {target[:64]!r}")


def _check_request_codings(values: list[str], raw: bytes, lines: list[bytes]) -> None:
    """A request's ``Transfer-Encoding`` must be exactly ``chunked`` (any case).

    400 for an empty or non-token element, for chunked applied twice, or when
    chunked is not the last coding (the body's end cannot be found: RFC 9112
    §6.3 requires a 400); 501 when the body is chunked but also carries a
    coding iopd does not implement, such as ``gzip, chunked`` (RFC 9112 §6.1).
    An HTAB anywhere in the field is a 400 too: llhttp refuses ``chunked``
    followed by one, and no client sends it.
    """
    if b"\t" in raw and any(
        b"\t" in line for line in lines if line[:18].lower() == b"transfer-encoding:"
    ):
        raise H1ProtocolError("HTAB in Transfer-Encoding")
    if len(values) == 1 and values[0].lower() == "chunked":  # the usual request
        return
    codings = [c.strip(" \t").lower() for value in values for c in value.split(",")]
    if codings == ["chunked"]:
        return
    if not all(_TOKEN_STR_RE.fullmatch(c) for c in codings):
        raise H1ProtocolError("invalid Transfer-Encoding")
    if codings[-1] != "chunked" or codings.count("chunked") > 1:
        raise H1ProtocolError("Transfer-Encoding of a request must end in a single chunked")
    unknown = ", ".join(c for c in codings if c != "chunked")
    raise H1ProtocolError(f"transfer-coding {unknown[:64]!r} is not implemented", status_hint=501)


def _is_decimal(value: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes '³' and other Unicode digits)."""
    return value.isascii() and value.isdigit()


def _chunk_size(buf: bytearray, start: int, nl: int) -> int:
    """The size on the chunk-size line ``buf[start:nl]`` (LF at ``nl``, CR before it).

    Hex digits, then maybe ``;extensions`` (checked, then ignored); nothing
    else: no whitespace, no bare CR or LF (a front end that reads an
    extension up to CRLF must see the same line end as we do).
    """
    end = nl - 1
    if end < start or buf[end] != 0x0D:
        raise H1ProtocolError("chunk-size line does not end in CRLF")
    line = buf[start:end]
    if 0 < len(line) <= 16 and not line.translate(None, _HEX_DIGITS):  # the usual line
        return int(line, 16)
    match = _CHUNK_SIZE_RE.fullmatch(line)
    if match is None:
        raise H1ProtocolError("invalid chunk-size line")
    return int(match.group(1), 16)


def _check_trailer_line(line: bytes) -> None:
    """One trailer field line: a header line, and not one that frames the message."""
    match = _HEADER_LINE_RE.fullmatch(line)
    if match is None:
        raise H1ProtocolError("invalid trailer line")
    if match.group(1).lower() in _FRAMING_FIELDS:
        raise H1ProtocolError("a framing header in the trailer section")


def _parse_headers(lines: list[bytes]) -> list[tuple[str, str]]:
    """Header lines (after the first line of ``lines``, line ends removed) as
    lower-case (name, value) pairs; values stripped of SP/HTAB and nothing else."""
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        hm = _HEADER_LINE_RE.fullmatch(line)
        if hm is None:
            if line[:1] in (b" ", b"\t"):
                raise H1ProtocolError("obsolete header line folding")
            raise H1ProtocolError(f"invalid header line {line[:64]!r}")
        headers.append(
            (hm.group(1).decode("ascii").lower(), hm.group(2).strip(_OWS).decode("latin-1"))
        )
    return headers
