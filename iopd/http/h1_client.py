"""Sans-IO HTTP/1.1, the provider client's side: requests rendered, responses read.

The node's provider client (``iopd.http.client``) writes requests built from
checked parts and reads the provider's response heads and bodies.  The
framing rules, limits and the body de-framing are shared with the edge's
request side in :mod:`iopd.http.h1`; what differs is here: a response line
may end in a bare LF (RFC 9112 §2.2 lets a recipient accept it, as h11 does),
1xx heads are skipped, and a body may run until the connection closes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from iopd.http.h1 import (
    _BAD_TARGET_RE,
    _METHOD_RE,
    _RESPONSE_HEAD_END_RE,
    _STATUS_LINE_RE,
    MAX_HEAD_BYTES,
    H1ProtocolError,
    _BodyReader,
    _is_decimal,
    _parse_headers,
    _render_head,
)

__all__ = ["ResponseHead", "ResponseReader", "render_request"]


def render_request(
    method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes
) -> bytes:
    """The bytes of one HTTP/1.1 request.  ``headers`` must carry Host and the framing.

    Every part is checked, because header values may come from a caller:
    a CR, LF or other control character anywhere raises :class:`H1ProtocolError`
    (no header injection into the provider request).
    """
    if not _METHOD_RE.fullmatch(method.encode("latin-1", "replace")):
        raise H1ProtocolError(f"illegal method {method[:32]!r}")
    if not target or _BAD_TARGET_RE.search(target):
        raise H1ProtocolError("illegal request target")
    head = _render_head(f"{method} {target} HTTP/1.1", headers)
    return head + body if body else head


@dataclass(slots=True)
class ResponseHead:
    """A final (non-1xx) response head.  Header names are lower-case."""

    status: int
    headers: list[tuple[str, str]]
    http_minor: int



class ResponseReader(_BodyReader):
    """Reads one response from bytes fed in (``receive_data``/``receive_eof``).

    Use: feed bytes until :meth:`read_head` returns the head, then call
    :meth:`read_body` after each feed; it returns the body bytes available
    (``b""`` when none) and sets :attr:`complete` at the end of the body.
    :attr:`reusable` says whether the connection may carry another request.
    """

    __slots__ = ("_head_only", "_scanned", "head", "keep_alive")

    def __init__(self, *, head_only: bool = False) -> None:
        super().__init__()
        self._head_only = head_only  # the request was HEAD: no body follows
        self._scanned = 0  # the head end is not in buf[:_scanned]: never rescanned
        self.head: ResponseHead | None = None
        self.keep_alive = False

    @property
    def reusable(self) -> bool:
        """The response is complete, keep-alive, and nothing else arrived after it."""
        return self.complete and self.keep_alive and not self._buf and not self._eof

    def read_head(self) -> ResponseHead | None:
        """The final response head, or None while it is incomplete.  1xx heads are skipped."""
        buf = self._buf
        while self.head is None:
            end = _RESPONSE_HEAD_END_RE.search(buf, self._scanned, MAX_HEAD_BYTES + 2)
            if end is None:
                if len(buf) > MAX_HEAD_BYTES:
                    raise H1ProtocolError("response head too large")
                if self._eof:
                    if buf:
                        raise H1ProtocolError("connection closed inside the response head")
                    raise H1ProtocolError("connection closed without a response")
                self._scanned = max(0, len(buf) - 2)
                return None
            raw = bytes(buf[: end.start()])
            del buf[: end.end()]
            self._scanned = 0
            head = _parse_response_head(raw)
            if head.status < 200:
                if head.status == 101:
                    raise H1ProtocolError("unexpected protocol switch (101)")
                continue  # 100 Continue, 103 Early Hints: informational only
            self._set_framing(head)
            self.head = head
        return self.head

    def _set_framing(self, head: ResponseHead) -> None:
        connection: list[str] = []
        codings: list[str] = []
        lengths: list[str] = []
        for name, value in head.headers:
            if name == "connection":
                connection += [t.strip(" \t").lower() for t in value.split(",")]
            elif name == "transfer-encoding":
                codings += [t.strip(" \t").lower() for t in value.split(",") if t.strip(" \t")]
            elif name == "content-length":
                lengths += [t.strip(" \t") for t in value.split(",")]
        self.keep_alive = head.http_minor >= 1 and "close" not in connection
        if self._head_only or head.status in (204, 304):
            self._framing = "none"
            self.complete = True
        elif codings:
            if codings[-1] != "chunked" or len(codings) > 1:
                raise H1ProtocolError(f"unsupported transfer-encoding {', '.join(codings)!r}")
            self._framing = "chunked"
            if lengths:  # both framings: chunked wins, but never reuse (RFC 9112 §6.3)
                self.keep_alive = False
        elif lengths:
            if len(set(lengths)) != 1 or not _is_decimal(lengths[0]) or len(lengths[0]) > 18:
                raise H1ProtocolError("invalid content-length")
            self._framing = "length"
            self._remaining = int(lengths[0])
            self.complete = self._remaining == 0
        else:
            self._framing = "close"
            self.keep_alive = False


def _parse_response_head(raw: bytes) -> ResponseHead:
    # A response line may end in LF alone (RFC 9112 §2.2 lets a recipient
    # accept it; h11 does); one CR before it is dropped, a second is an error.
    lines = [line[:-1] if line[-1:] == b"\r" else line for line in raw.split(b"\n")]
    match = _STATUS_LINE_RE.fullmatch(lines[0])
    if match is None:
        raise H1ProtocolError(f"invalid status line {lines[0][:64]!r}")
    return ResponseHead(
        status=int(match.group(2)), headers=_parse_headers(lines), http_minor=int(match.group(1))
    )
