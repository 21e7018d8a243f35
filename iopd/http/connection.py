"""The sans-IO state machine of one server-side HTTP/1.1 connection.

Why a table: every legal move of a connection is written down once, as data,
in ``TRANSITIONS``, and ``HttpConnection._apply`` is the only place that
changes state (as ``wire.connection`` does for the Edge-Node wire).  What the
limits decide (a head or body too large, the in-flight body budget), which
deadline applies in which state (``DEADLINES``), what a timeout answers, and
what a refusal does to the connection are decided here, in plain synchronous
code tested byte by byte without trio (``tests/http/test_connection.py``).
The trio transport (``iopd.http.server``) only moves bytes, arms the deadline
this machine names, runs the handler and writes what it is told to.

The life of a connection::

    IDLE --first byte--> HEAD --head admitted--> BODY --body in--> HANDLER
     ^                     |                       |                  |
     |                     +------- refused -------+                  |
     |                                 v                              |
     |                  REFUSING --sent--> LINGER --> CLOSED          |
     +------------- response done, connection reusable --------------+

    any state --EOF, idle timeout, shutdown, a broken write--> CLOSED

* IDLE waits ``idle_timeout`` for the next request; a timeout or a shutdown
  closes quietly.  HEAD waits ``header_timeout`` from the request's first
  byte, BODY ``body_timeout`` from the first wait for body bytes; a timeout
  in either answers 408.  HANDLER has no deadline: a response that keeps
  moving is never cut (the transport bounds each write by ``send_timeout``).
* Decide from the head: in HEAD, once the head is parsed and before any body
  byte is read or ``100 Continue`` is sent, the head hook (route, method,
  caller), the declared size and the in-flight body budget are checked.  A
  ``Content-Length`` is reserved from the budget whole; a chunked body is
  reserved piece by piece as it comes.  The reservation is given back as soon
  as the body is in or given up on (any move out of BODY).
* A refusal (REFUSING) is answered with ``Connection: close``; once written,
  the connection lingers (LINGER: up to ``LINGER_SECONDS`` and
  ``LINGER_MAX_BYTES`` of what the client still sends are read and dropped)
  so that closing does not reset the connection before the client read it.
* After a handler, the connection is reused only if the response was
  complete, both sides allowed it and the listener is not shutting down.

The response itself (head, chunks, held bytes) is the ``Responder``'s
(``iopd.http.responder``): the handler drives it, this machine only learns
whether it ended cleanly.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from iopd.http.errors import (
    BodyBudgetFull,
    ContentTooLarge,
    HttpError,
    Refusal,
    RequestTooSlow,
    internal_error,
    protocol_error,
)
from iopd.http.h1 import H1ProtocolError, RequestHead, RequestReader

log = logging.getLogger("iopd.http.server")

#: After a refusal sent before the request was fully read, keep draining the
#: client's bytes this long (and at most this much).
LINGER_SECONDS = 1.0
LINGER_MAX_BYTES = 1024 * 1024
_OVERLOADED = "the server is receiving too many request bodies at once; retry later"

Headers = list[tuple[str, str]]
class HeadContext:
    """A base for what a head hook returns: headers every response to the
    request carries (the OpenAI listener's CORS headers), the handler's and
    this layer's refusals alike.  They replace a handler's headers of the
    same name (a relayed provider's own ``Access-Control-*``)."""

    __slots__ = ("response_headers",)

    def __init__(self, response_headers: Headers | None = None) -> None:
        self.response_headers: Headers = response_headers or []


#: The head hook: ``(method, path, headers) -> context``, called once a request
#: head is parsed and before any body byte is read or ``100 Continue`` sent.
#: It raises a :class:`~iopd.http.errors.Refusal` to refuse the request, having
#: logged and counted the refusal itself (the server answers it, without
#: ``on_reject``, and closes the connection); what it returns (a
#: :class:`HeadContext`, which the owner subclasses) is ``Request.context``.  Synchronous: it decides from what is in hand.
HeadCheck = Callable[[str, str, Headers], HeadContext | None]


def context_headers(context: HeadContext | None) -> Headers:
    """The headers a head hook's context adds to every response ([] for none)."""
    return context.response_headers if context is not None else []


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Size limits (bytes) and timeouts (seconds) of one listener."""

    max_body_bytes: int = 8 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    idle_timeout: float = 30.0
    #: Connections served at once; past it new ones wait in the listen backlog.
    max_connections: int = 4096
    #: Request-body bytes being received at once, all connections together.
    max_inflight_body_bytes: int = 256 * 1024 * 1024
    #: A response write that makes no progress this long cuts the connection.
    send_timeout: float = 30.0


@dataclass(slots=True)
class Request:
    """One parsed request with its complete body.  Header names are lower-case."""

    method: str
    target: str
    path: str
    query: str
    headers: Headers
    body: bytes
    client: tuple[str, int] | None
    http_version: str
    #: What the server's ``head_check`` returned for this request (None without one).
    context: HeadContext | None = None

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None


class _FastHashEnum(enum.Enum):
    """An Enum hashed by identity (members are singletons; ``Enum.__hash__`` is Python)."""

    __hash__ = object.__hash__


class ConnState(_FastHashEnum):
    """Where one connection is."""

    IDLE = "idle"  # between requests: waiting for the next one's first byte
    HEAD = "head"  # a request's first bytes are in, its head is not
    BODY = "body"  # the head passed every check: its body is arriving
    HANDLER = "handler"  # the request is complete: the handler runs and answers
    REFUSING = "refusing"  # answering a refusal decided here; the connection closes after it
    LINGER = "linger"  # the refusal is out: drop what still arrives, then close
    CLOSED = "closed"


class ConnEvent(_FastHashEnum):
    """What moves a connection."""

    DATA = "data"  # the next request's first bytes
    ADMIT = "admit"  # the head passed the hook, the size limit and the budget
    COMPLETE = "complete"  # the body is in
    REUSE = "reuse"  # the response ended cleanly and the connection may carry another
    REFUSE = "refuse"  # malformed, too large, too slow, over budget, or refused by the hook
    SENT = "sent"  # the refusal was written
    CLOSE = "close"  # EOF, idle timeout, shutdown, a broken or cut response


_S, _E = ConnState, ConnEvent

#: state -> event -> next state.  Anything absent is a bug in the transport.
TRANSITIONS: dict[ConnState, dict[ConnEvent, ConnState]] = {
    _S.IDLE: {_E.DATA: _S.HEAD, _E.CLOSE: _S.CLOSED},
    _S.HEAD: {_E.ADMIT: _S.BODY, _E.REFUSE: _S.REFUSING, _E.CLOSE: _S.CLOSED},
    _S.BODY: {_E.COMPLETE: _S.HANDLER, _E.REFUSE: _S.REFUSING, _E.CLOSE: _S.CLOSED},
    _S.HANDLER: {_E.REUSE: _S.IDLE, _E.CLOSE: _S.CLOSED},
    _S.REFUSING: {_E.SENT: _S.LINGER, _E.CLOSE: _S.CLOSED},
    _S.LINGER: {_E.CLOSE: _S.CLOSED},
    _S.CLOSED: {_E.CLOSE: _S.CLOSED},
}

#: The states that wait on the client, and the ``HttpLimits`` field that bounds
#: each wait (armed when the state is entered, not restarted by each byte).
DEADLINES: dict[ConnState, str] = {
    _S.IDLE: "idle_timeout",
    _S.HEAD: "header_timeout",
    _S.BODY: "body_timeout",
}
#: What a deadline answers in each state: close quietly (None), or a 408 naming
#: what was too slow.
TIMEOUT_ANSWERS: dict[ConnState, str | None] = {
    _S.IDLE: None,
    _S.HEAD: "headers",
    _S.BODY: "body",
}


class Signal(_FastHashEnum):
    """What :meth:`HttpConnection.next_event` asks of the transport, besides a request."""

    NEED_DATA = "need_data"  # receive (under the state's deadline), then feed the bytes
    SEND_CONTINUE = "send_continue"  # write ``100 Continue``, then ask again
    CLOSE = "close"  # close the connection without a word


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer ``error`` (``Connection: close``), then linger and close.

    ``by_head_check``: the head hook refused, and already logged and counted
    it.  ``context``: what the hook returned when it had admitted the request.
    ``head_request``: the refused request is a ``HEAD`` (its answer has no body).
    """

    error: Refusal
    by_head_check: bool = False
    context: HeadContext | None = None
    head_request: bool = False


class ListenerState:
    """What every connection of one listener shares: limits, the head hook,
    the in-flight body budget and whether the listener is shutting down."""

    __slots__ = ("limits", "head_check", "closing", "body_bytes", "timeouts")

    def __init__(self, limits: HttpLimits, head_check: HeadCheck | None = None) -> None:
        self.limits = limits
        self.head_check = head_check
        self.closing = False
        #: Body bytes reserved by the bodies being received now.
        self.body_bytes = 0
        #: ``DEADLINES`` resolved to seconds.
        self.timeouts = {state: float(getattr(limits, name)) for state, name in DEADLINES.items()}

    def reserve_body(self, size: int) -> bool:
        """Count ``size`` more body bytes as being received; False past the budget."""
        total = self.body_bytes + size
        if total > self.limits.max_inflight_body_bytes:
            return False
        self.body_bytes = total
        return True


class _Incoming:
    """The request being read: its head and what has arrived of its body."""

    __slots__ = ("head", "path", "query", "context", "parts", "size", "count_pieces")

    def __init__(self, head: RequestHead) -> None:
        self.head = head
        self.path, _, self.query = head.target.partition("?")
        #: What the head hook returned (None until it admitted the request).
        self.context: HeadContext | None = None
        self.parts: list[bytes] = []
        self.size = 0
        # Chunked: reserve each piece from the budget as it comes.
        self.count_pieces = head.content_length is None


class HttpConnection:
    """One server-side connection: bytes in, requests and decisions out.

    ``receive_data``/``receive_eof`` feed the client's bytes; ``next_event``
    says what to do next (a :class:`Request` to hand to the handler, a
    :class:`Refuse`, or a :class:`Signal`); ``timed_out`` is called when the
    deadline of :attr:`timeout` passed; ``finish_response`` after a handler.
    No I/O happens here.
    """

    __slots__ = (
        "_listener",
        "client",
        "state",
        "_moves",
        "_reader",
        "_eof",
        "_incoming",
        "_reserved",
        "keep_alive",
    )

    def __init__(self, listener: ListenerState, client: tuple[str, int] | None = None) -> None:
        self._listener = listener
        self.client = client
        self.state = ConnState.IDLE
        self._moves = TRANSITIONS[ConnState.IDLE]  # the legal moves from ``state``
        self._reader = RequestReader(listener.limits.max_header_bytes)
        self._eof = False  # the client closed its side
        self._incoming: _Incoming | None = None
        # Body bytes this request holds of the listener's budget.
        self._reserved = 0
        #: The request being served allows another after it (HTTP/1.1, no ``close``).
        self.keep_alive = False

    # ------------------------------------------------------------ queries

    @property
    def timeout(self) -> float:
        """Seconds the current state may wait on the client (see ``DEADLINES``)."""
        return self._listener.timeouts[self.state]

    @property
    def context(self) -> HeadContext | None:
        """What the head hook returned for the request being read (None before)."""
        incoming = self._incoming
        return incoming.context if incoming is not None else None

    # ------------------------------------------------------------ events

    def receive_data(self, data: bytes) -> None:
        """Bytes that ended a wait.  In IDLE they start a request (even blank lines:
        from the first byte on, the request is in flight and its head is timed)."""
        if self.state is ConnState.IDLE:
            self._apply(ConnEvent.DATA)
        self._reader.receive_data(data)

    def receive_pipelined(self, data: bytes) -> None:
        """Bytes already in hand when a request cycle begins (pipelined during the
        last response): a request starts only if they hold more than blank lines."""
        self._reader.receive_data(data)

    def receive_eof(self) -> None:
        """The client closed its side (or the connection broke)."""
        self._eof = True
        self._reader.receive_eof()

    def next_event(self) -> Request | Refuse | Signal:
        """What to do next, reading as far as the bytes in hand allow."""
        try:
            state = self.state
            if state is ConnState.BODY:
                return self._read_body()
            if state is ConnState.IDLE:
                try:
                    head = self._reader.read_head()  # skips blank lines between requests
                except H1ProtocolError:
                    # Bytes already in hand (pipelined) that are no request:
                    # a request began, and its refusal is answered.
                    self._apply(ConnEvent.DATA)
                    raise
                if head is None and not self._reader.buffered:
                    if self._eof or self._listener.closing:
                        return self._close()
                    return Signal.NEED_DATA
                self._apply(ConnEvent.DATA)
            elif state is not ConnState.HEAD:
                raise RuntimeError(f"next_event() in connection state {state.value}")
            head = self._reader.read_head()
            if head is None:
                if self._eof:
                    return self._close()  # only blank lines had come
                return Signal.NEED_DATA
            refusal = self._admit(head)
            if refusal is not None:
                return refusal
            if head.expect_continue and not self._reader.complete:
                return Signal.SEND_CONTINUE
            return self._read_body()
        except H1ProtocolError as exc:
            return self._refuse(protocol_error(exc))

    def timed_out(self) -> Refuse | Signal:
        """The deadline of the current state passed: close quietly, or answer 408."""
        what = TIMEOUT_ANSWERS.get(self.state)
        if what is None:
            return self._close()
        return self._refuse(RequestTooSlow(f"request {what} not received in time"))

    def finish_response(self, reusable: bool) -> bool:
        """The handler is done.  ``reusable``: its response ended cleanly on a
        connection still whole.  True when the connection carries another request
        (the bytes after this request are then the next one's start)."""
        if reusable and self.keep_alive and not self._listener.closing:
            leftover = self._reader.leftover()
            self._reader = RequestReader(self._listener.limits.max_header_bytes)
            if leftover:
                self._reader.receive_data(leftover)
            self._incoming = None
            self._apply(ConnEvent.REUSE)
            return True
        self._close()
        return False

    def refusal_sent(self) -> None:
        """The refusal is written: linger before closing."""
        self._apply(ConnEvent.SENT)

    def close(self) -> None:
        """Close from wherever the connection is (gives back any body reservation)."""
        self._apply(ConnEvent.CLOSE)

    # ------------------------------------------------------------ internals

    def _close(self) -> Signal:
        self._apply(ConnEvent.CLOSE)
        return Signal.CLOSE

    def _refuse(self, error: Refusal, *, by_head_check: bool = False) -> Refuse:
        incoming = self._incoming
        context = incoming.context if incoming is not None else None
        head_request = incoming is not None and incoming.head.method == "HEAD"
        self._apply(ConnEvent.REFUSE)
        return Refuse(error, by_head_check, context, head_request)

    def _admit(self, head: RequestHead) -> Refuse | None:
        """Everything decided from the head, before a body byte is read: the head
        hook (route, method, caller), the declared size, the in-flight budget."""
        listener = self._listener
        incoming = self._incoming = _Incoming(head)
        check = listener.head_check
        if check is not None:
            try:
                incoming.context = check(head.method, incoming.path, head.headers)
            except Exception as exc:
                if isinstance(exc, Refusal):
                    return self._refuse(exc, by_head_check=True)
                log.exception("event=callback_failed component=http callback=head_check")
                return self._refuse(internal_error())
        length = head.content_length
        if length:
            if length > listener.limits.max_body_bytes:
                return self._refuse(ContentTooLarge("request body too large"))
            if not listener.reserve_body(length):
                return self._refuse(BodyBudgetFull(_OVERLOADED))
            self._reserved = length
        self.keep_alive = head.keep_alive
        self._apply(ConnEvent.ADMIT)
        return None

    def _read_body(self) -> Request | Refuse | Signal:
        reader = self._reader
        incoming = self._incoming
        assert incoming is not None
        limits = self._listener.limits
        part = reader.read_body()  # all that can be de-framed from what is in hand
        if part:
            incoming.size += len(part)
            if incoming.size > limits.max_body_bytes:
                return self._refuse(ContentTooLarge("request body too large"))
            if incoming.count_pieces:
                if not self._listener.reserve_body(len(part)):
                    return self._refuse(BodyBudgetFull(_OVERLOADED))
                self._reserved += len(part)
            incoming.parts.append(part)
        if not reader.complete:
            return Signal.NEED_DATA
        self._apply(ConnEvent.COMPLETE)
        head = incoming.head
        parts = incoming.parts
        return Request(
            method=head.method,
            target=head.target,
            path=incoming.path,
            query=incoming.query,
            headers=head.headers,
            body=parts[0] if len(parts) == 1 else b"".join(parts),
            client=self.client,
            http_version=head.http_version,
            context=incoming.context,
        )

    def _apply(self, event: ConnEvent) -> None:
        """The one place where state changes; leaving BODY (or HEAD, where a
        declared length is reserved) gives the body reservation back."""
        next_state = self._moves.get(event)
        if next_state is None:
            raise RuntimeError(f"{event.value} is not legal in connection state {self.state.value}")
        if self._reserved and next_state is not ConnState.BODY:
            self._listener.body_bytes -= self._reserved
            self._reserved = 0
        self.state = next_state
        self._moves = TRANSITIONS[next_state]


__all__ = [
    "DEADLINES",
    "LINGER_MAX_BYTES",
    "LINGER_SECONDS",
    "TIMEOUT_ANSWERS",
    "TRANSITIONS",
    "ConnEvent",
    "ConnState",
    "HeadCheck",
    "HeadContext",
    "HttpConnection",
    "HttpError",
    "HttpLimits",
    "ListenerState",
    "Refuse",
    "Request",
    "Signal",
    "context_headers",
]
