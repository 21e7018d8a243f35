"""The one response writer: heads, framing, held bytes, against a recording sink."""

from __future__ import annotations

import h11
import pytest
import trio

from iopd.http.responder import Responder


class _Server:
    server_header = "iopd-test"

    def __init__(self) -> None:
        self.closing = False


class _Sink:
    """A connection that records every write (``send_now`` takes it all unless ``full``)."""

    def __init__(self) -> None:
        self.torn = False
        self.server = _Server()
        self.writes: list[bytes] = []
        self.full = False
        self.unsent = False

    async def send_bytes(self, data: bytes, scope: trio.CancelScope | None) -> None:
        self.writes.append(data)

    def send_now(self, data: bytes) -> bool:
        if self.full:
            return False
        self.writes.append(data)
        return True


def _parse(data: bytes, method: str = "GET") -> tuple[h11.Response, bytes, bool]:
    """The response as h11 reads it: the head, the body, whether it ended."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    head: h11.Response | None = None
    body = b""
    ended = False
    while True:
        event = client.next_event()
        if isinstance(event, h11.Response):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            ended = True
        else:
            break
    assert head is not None
    return head, body, ended


def _headers(head: h11.Response) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in head.headers}


def test_a_whole_response_has_its_length_and_the_servers_headers() -> None:
    sink = _Sink()
    responder = Responder(sink, False, None)
    trio.run(responder.send, 200, [("content-type", "text/plain")], b"hello")
    assert len(sink.writes) == 1  # head and body in one write
    head, body, ended = _parse(sink.writes[0])
    headers = _headers(head)
    assert (head.status_code, body, ended) == (200, b"hello", True)
    assert headers["content-length"] == "5" and headers["server"] == "iopd-test"
    assert "date" in headers and "connection" not in headers
    assert responder.finished


def test_no_body_for_a_head_request_or_a_204() -> None:
    sink = _Sink()
    trio.run(Responder(sink, True, None).send, 200, [], b"hello")
    head, body, _ = _parse(sink.writes[0], "HEAD")
    assert body == b"" and _headers(head)["content-length"] == "5"
    sink = _Sink()
    trio.run(Responder(sink, False, None).send, 204, [], b"ignored")
    assert b"ignored" not in sink.writes[0] and b"content-length" not in sink.writes[0]


def test_a_streamed_response_is_chunked_and_drops_the_handlers_framing() -> None:
    sink = _Sink()
    responder = Responder(sink, False, None)

    async def stream() -> None:
        await responder.start(200, [("Content-Length", "99"), ("x-a", "1")])
        await responder.write(b"ab")
        await responder.write(b"")  # ignored
        await responder.write(b"cde")
        await responder.end()
        await responder.end()  # a second end writes nothing

    trio.run(stream)
    head, body, ended = _parse(b"".join(sink.writes))
    headers = _headers(head)
    assert (body, ended) == (b"abcde", True)
    assert headers["transfer-encoding"] == "chunked" and "content-length" not in headers
    assert len(sink.writes) == 4  # head, two chunks, the last chunk


def test_held_bytes_leave_with_the_next_unheld_write() -> None:
    sink = _Sink()
    responder = Responder(sink, False, None)

    async def stream() -> None:
        await responder.start(200, [], hold=True)
        await responder.write(b"one", hold=True)
        assert sink.writes == []
        await responder.write(b"two")
        await responder.end()

    trio.run(stream)
    assert len(sink.writes) == 2
    _, body, ended = _parse(b"".join(sink.writes))
    assert (body, ended) == (b"onetwo", True)


def test_a_close_delimited_body_closes_the_connection() -> None:
    sink = _Sink()
    responder = Responder(sink, False, None, chunked=False)

    async def stream() -> None:
        await responder.start(200, [])
        await responder.write(b"raw")
        await responder.end()

    trio.run(stream)
    data = b"".join(sink.writes)
    assert b"connection: close" in data.lower() and data.endswith(b"raw")
    assert not responder.keep_alive


def test_a_closing_server_and_the_head_contexts_headers() -> None:
    sink = _Sink()
    sink.server.closing = True
    responder = Responder(sink, False, None, extra_headers=[("X-Group", "g1")])
    trio.run(responder.send, 200, [("x-group", "handler's"), ("x-b", "2")], b"")
    headers = _headers(_parse(sink.writes[0])[0])
    assert headers["x-group"] == "g1" and headers["x-b"] == "2"  # the context's replace
    assert headers["connection"] == "close" and not responder.keep_alive


def test_the_nowait_steps_and_a_full_socket() -> None:
    sink = _Sink()
    responder = Responder(sink, False, None)
    assert not responder.write_held(b"x")  # before the start: nothing done
    responder.start_held(200, [])
    assert responder.write_held(b"abc") and responder.end_held()
    assert not responder.end_held()  # already ended
    sink.full = True
    assert not responder.flush_nowait() and sink.writes == []  # kept for the handler
    sink.full = False
    assert responder.flush_nowait()
    _, body, ended = _parse(b"".join(sink.writes))
    assert (body, ended) == (b"abc", True)
    assert responder.flush_nowait()  # nothing held: nothing to do


def test_misuse_is_a_programming_error() -> None:
    responder = Responder(_Sink(), False, None)

    async def write_first() -> None:
        await responder.write(b"x")

    with pytest.raises(RuntimeError):
        trio.run(write_first)
    trio.run(responder.send, 200, [], b"")
    with pytest.raises(RuntimeError, match="already started"):
        trio.run(responder.send, 200, [], b"")
