"""The HTTP connection state machine, byte by byte, with no trio and no socket."""

from __future__ import annotations

import pytest

from iopd.http.connection import (
    DEADLINES,
    TRANSITIONS,
    ConnEvent,
    ConnState,
    HeadContext,
    HttpConnection,
    HttpLimits,
    ListenerState,
    Refuse,
    Request,
    Signal,
)
from iopd.http.errors import Refusal
from iopd.http.h1 import H1ProtocolError

LIMITS = HttpLimits(
    max_body_bytes=100,
    max_header_bytes=256,
    header_timeout=5.0,
    body_timeout=7.0,
    idle_timeout=11.0,
    max_inflight_body_bytes=150,
)
GET = b"GET /a?b=c HTTP/1.1\r\nHost: x\r\n\r\n"


def post(body: bytes, extra: str = "") -> bytes:
    return (
        f"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body
    )


def machine(**kwargs: object) -> tuple[HttpConnection, ListenerState]:
    listener = ListenerState(LIMITS, **kwargs)  # type: ignore[arg-type]
    return HttpConnection(listener, ("127.0.0.1", 5)), listener


def feed_bytewise(conn: HttpConnection, data: bytes) -> Request | Refuse | Signal:
    """Feed ``data`` one byte per wait, as a slow client would, until the machine
    decides something other than "more"."""
    event = conn.next_event()
    for i in range(len(data)):
        if event is not Signal.NEED_DATA:
            break
        conn.receive_data(data[i : i + 1])
        event = conn.next_event()
    return event


class _Refused(Exception):
    """An owner's error, recognised by shape."""

    status, code = 401, "invalid_api_key"

    def __init__(self) -> None:
        super().__init__("no")
        self.message = "no"
        self.headers: list[tuple[str, str]] = []


# ------------------------------------------------------------------ the table


def test_every_state_can_close_and_only_closed_is_terminal() -> None:
    assert set(TRANSITIONS) == set(ConnState)
    for state, moves in TRANSITIONS.items():
        assert moves.get(ConnEvent.CLOSE) is ConnState.CLOSED, state
    assert set(DEADLINES) == {ConnState.IDLE, ConnState.HEAD, ConnState.BODY}


def test_an_illegal_move_is_a_bug_not_a_silent_change() -> None:
    conn, _ = machine()
    with pytest.raises(RuntimeError):
        conn.refusal_sent()  # nothing was refused
    assert conn.state is ConnState.IDLE


# ------------------------------------------------------------- the happy path


def test_a_request_byte_by_byte_walks_idle_head_body_handler() -> None:
    conn, listener = machine()
    data = post(b"hello")
    event = conn.next_event()
    assert event is Signal.NEED_DATA and conn.state is ConnState.IDLE
    assert conn.timeout == LIMITS.idle_timeout
    conn.receive_data(data[:1])
    assert conn.state is ConnState.HEAD and conn.timeout == LIMITS.header_timeout
    event = feed_bytewise(conn, data[1:])
    assert isinstance(event, Request)
    assert (event.method, event.path, event.body, event.client) == (
        "POST",
        "/p",
        b"hello",
        ("127.0.0.1", 5),
    )
    assert conn.state is ConnState.HANDLER
    assert listener.body_bytes == 0  # the reservation ended with the body


def test_the_body_state_names_the_body_timeout() -> None:
    conn, listener = machine()
    conn.receive_data(post(b"hello")[:-2])
    assert conn.next_event() is Signal.NEED_DATA
    assert conn.state is ConnState.BODY and conn.timeout == LIMITS.body_timeout
    assert listener.body_bytes == 5  # reserved from the head


def test_keep_alive_carries_pipelined_bytes_into_the_next_request() -> None:
    conn, _ = machine()
    conn.receive_data(GET + GET[:10])
    first = conn.next_event()
    assert isinstance(first, Request) and first.query == "b=c"
    assert conn.finish_response(True) and conn.state is ConnState.IDLE
    assert conn.next_event() is Signal.NEED_DATA and conn.state is ConnState.HEAD
    conn.receive_data(GET[10:])
    assert isinstance(conn.next_event(), Request)


def test_connection_close_or_an_unclean_response_ends_the_connection() -> None:
    conn, _ = machine()
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert isinstance(conn.next_event(), Request)
    assert not conn.finish_response(True) and conn.state is ConnState.CLOSED
    conn, _ = machine()
    conn.receive_data(GET)
    assert isinstance(conn.next_event(), Request)
    assert not conn.finish_response(False)


def test_shutdown_closes_an_idle_connection_but_not_a_request_under_way() -> None:
    conn, listener = machine()
    conn.receive_data(GET)
    assert isinstance(conn.next_event(), Request)
    listener.closing = True
    assert not conn.finish_response(True)
    conn, listener = machine()
    listener.closing = True
    assert conn.next_event() is Signal.CLOSE


def test_blank_lines_in_hand_between_requests_do_not_start_one() -> None:
    conn, _ = machine()
    conn.receive_pipelined(b"\r\n\r\n")
    assert conn.next_event() is Signal.NEED_DATA and conn.state is ConnState.IDLE
    conn.receive_eof()
    assert conn.next_event() is Signal.CLOSE


def test_expect_continue_is_asked_for_only_after_the_head_passed() -> None:
    conn, _ = machine()
    conn.receive_data(post(b"ab", "Expect: 100-continue\r\n")[:-2])
    assert conn.next_event() is Signal.SEND_CONTINUE and conn.state is ConnState.BODY
    assert conn.next_event() is Signal.NEED_DATA
    conn.receive_data(b"ab")
    assert isinstance(conn.next_event(), Request)
    conn, _ = machine(head_check=lambda m, p, h: (_ for _ in ()).throw(_Refused()))
    conn.receive_data(post(b"ab", "Expect: 100-continue\r\n")[:-2])
    assert isinstance(conn.next_event(), Refuse)


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"HELLO\r\n\r\n", 400, "invalid_request_error"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 300, 431, "headers_too_large"),
        (post(b"x" * 101), 413, "request_too_large"),
        (
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n65\r\n" + b"x" * 101,
            413,
            "request_too_large",
        ),
    ],
)
def test_what_the_limits_and_the_parser_refuse(data: bytes, status: int, code: str) -> None:
    conn, listener = machine()
    event = feed_bytewise(conn, data)
    assert isinstance(event, Refuse) and not event.by_head_check
    assert (event.error.status, event.error.code) == (status, code)
    assert conn.state is ConnState.REFUSING and listener.body_bytes == 0
    conn.refusal_sent()
    assert conn.state is ConnState.LINGER
    conn.close()
    assert conn.state is ConnState.CLOSED


def test_a_body_past_the_inflight_budget_is_refused_from_its_head() -> None:
    one, listener = machine()
    two = HttpConnection(listener)
    one.receive_data(post(b"x" * 100)[:-1])
    assert one.next_event() is Signal.NEED_DATA and listener.body_bytes == 100
    two.receive_data(post(b"y" * 60)[:-60])
    event = two.next_event()
    assert isinstance(event, Refuse) and event.error.code == "overloaded"
    assert ("Retry-After", "1") in event.error.headers
    one.receive_data(b"x")
    assert isinstance(one.next_event(), Request) and listener.body_bytes == 0


def test_a_chunked_body_is_reserved_piece_by_piece() -> None:
    conn, listener = machine()
    conn.receive_data(
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
    )
    assert conn.next_event() is Signal.NEED_DATA and listener.body_bytes == 3
    conn.receive_data(b"0\r\n\r\n")
    event = conn.next_event()
    assert isinstance(event, Request) and event.body == b"abc" and listener.body_bytes == 0


def test_closing_mid_body_gives_the_reservation_back() -> None:
    conn, listener = machine()
    conn.receive_data(post(b"x" * 50)[:-10])
    assert conn.next_event() is Signal.NEED_DATA and listener.body_bytes == 50
    conn.close()  # the transport was cancelled
    assert listener.body_bytes == 0


def test_eof_inside_the_request_is_a_400_but_between_requests_a_quiet_close() -> None:
    conn, _ = machine()
    conn.receive_data(post(b"hello")[:-2])
    assert conn.next_event() is Signal.NEED_DATA
    conn.receive_eof()
    event = conn.next_event()
    assert isinstance(event, Refuse) and event.error.status == 400
    conn, _ = machine()
    assert conn.next_event() is Signal.NEED_DATA
    conn.receive_eof()
    assert conn.next_event() is Signal.CLOSE


@pytest.mark.parametrize(("hint", "status"), [(400, 400), (405, 405), (431, 431), (501, 501)])
def test_a_parser_error_maps_by_its_status_hint(hint: int, status: int) -> None:
    from iopd.http.errors import protocol_error

    assert protocol_error(H1ProtocolError("x", status_hint=hint)).status == status


# ---------------------------------------------------------------- deadlines


def test_a_timeout_closes_quietly_when_idle_and_answers_408_otherwise() -> None:
    conn, _ = machine()
    assert conn.next_event() is Signal.NEED_DATA
    assert conn.timed_out() is Signal.CLOSE and conn.state is ConnState.CLOSED
    for data, what in ((b"GET / HT", "headers"), (post(b"abc")[:-1], "body")):
        conn, listener = machine()
        conn.receive_data(data)
        assert conn.next_event() is Signal.NEED_DATA
        event = conn.timed_out()
        assert isinstance(event, Refuse) and event.error.status == 408
        assert what in event.error.message and listener.body_bytes == 0


# ---------------------------------------------------------------- head hook


def test_the_head_hook_decides_before_the_body_and_its_context_rides_along() -> None:
    seen: list[tuple[str, str]] = []

    ctx = HeadContext()

    def check(method: str, path: str, headers: list[tuple[str, str]]) -> HeadContext:
        seen.append((method, path))
        return ctx

    conn, _ = machine(head_check=check)
    conn.receive_data(post(b"abc")[:-3])
    assert conn.next_event() is Signal.NEED_DATA and seen == [("POST", "/p")]
    conn.receive_data(b"abc")
    event = conn.next_event()
    assert isinstance(event, Request) and event.context is ctx


def test_a_hook_refusal_is_the_owners_and_a_crash_is_a_generic_500() -> None:
    def refuse(method: str, path: str, headers: list[tuple[str, str]]) -> object:
        raise _Refused()

    conn, listener = machine(head_check=refuse)
    conn.receive_data(post(b"x" * 100)[:-100])
    event = conn.next_event()
    assert isinstance(event, Refuse) and event.by_head_check
    assert isinstance(event.error, _Refused) and isinstance(event.error, Refusal)
    assert listener.body_bytes == 0  # nothing reserved for a refused caller

    assert not event.head_request  # a POST: its refusal has a body
    conn, _ = machine(head_check=refuse)
    conn.receive_data(b"HEAD /p HTTP/1.1\r\nHost: x\r\n\r\n")
    event = conn.next_event()
    assert isinstance(event, Refuse) and event.head_request  # answered without a body

    def crash(method: str, path: str, headers: list[tuple[str, str]]) -> object:
        raise ValueError("secret")

    conn, _ = machine(head_check=crash)
    conn.receive_data(GET)
    event = conn.next_event()
    assert isinstance(event, Refuse) and not event.by_head_check
    assert event.error.status == 500 and "secret" not in event.error.message


def test_a_refusal_after_the_hook_admitted_carries_its_context() -> None:
    admitted = HeadContext([("x-admitted", "yes")])
    conn, _ = machine(head_check=lambda m, p, h: admitted)
    conn.receive_data(post(b"x" * 101))
    event = conn.next_event()
    assert isinstance(event, Refuse) and event.context is admitted


def test_pipelined_garbage_after_a_response_is_refused_not_a_crash() -> None:
    """Bytes in hand when the next cycle begins that are no request (found by the
    HTTP fuzzer): the parser raises while the connection is IDLE; the refusal
    belongs to a request that began, so it is a legal move, answered with 400."""
    conn, _ = machine()
    conn.receive_data(GET + b": 33\r\n\r\n")
    assert isinstance(conn.next_event(), Request)
    assert conn.finish_response(True) and conn.state is ConnState.IDLE
    refused = conn.next_event()
    assert isinstance(refused, Refuse) and refused.error.status == 400
    assert conn.state is ConnState.REFUSING
