"""iopd.http.server over real sockets on port 0, driven by raw trio TCP clients."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Awaitable, Callable

import h11
import pytest
import trio
import trio.testing

from iopd.edge.openai.outgoing.error_envelope import render_error
from iopd.errors import AuthenticationError, MethodNotAllowed, QueueTimeout, RouteNotFound
from iopd.http.server import (
    AbortResponse,
    ClientDisconnected,
    HeadContext,
    HttpLimits,
    HttpServer,
    Request,
    Responder,
    serve_http,
)
from tests.support.http_server import LIMITS, Client, connect, echo_handler, get, running


def post(body: bytes, path: str = "/", extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def envelope(body: bytes) -> dict[str, object]:
    data = json.loads(body)
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "code", "param"}
    return data["error"]  # type: ignore[no-any-return]


async def test_keep_alive_reuses_the_connection() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(post(b"hello", "/a?x=1"))
            status, _, body = await client.response(b"POST")
            first = json.loads(body)
            assert status == 200
            assert first["body"] == "hello" and first["path"] == "/a" and first["query"] == "x=1"
            assert first["host"] == "x"
            await client.send(get("/b"))
            status, headers, body = await client.response()
            second = json.loads(body)
            assert status == 200 and second["path"] == "/b"
            assert second["client_port"] == first["client_port"]
            assert headers["server"] == "iopd"
            assert "date" in headers


async def test_a_request_complete_as_its_read_deadline_fires_is_still_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The handler runs in the scope that bounded the request's read.  When
    that read's deadline fired in the very round the last bytes came, the
    scope's cancel is pending, not raised: the complete request is served
    (in a scope of its own), twice on one connection."""
    from iopd.http import transport

    real = transport.ServedConnection._read_request

    async def read_then_expire(
        self: transport.ServedConnection, deadline: trio.CancelScope
    ) -> object:
        event = await real(self, deadline)
        if isinstance(event, Request):
            deadline.cancel()  # as the run loop does at the deadline, with no checkpoint after
        return event

    monkeypatch.setattr(transport.ServedConnection, "_read_request", read_then_expire)
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            for path in ("/a", "/b"):
                await client.send(get(path))
                status, _, body = await client.response()
                assert status == 200 and json.loads(body)["path"] == path


async def test_connection_close_closes_after_the_response() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(get("/", "Connection: close\r\n"))
            status, headers, _ = await client.response()
            assert status == 200
            assert headers.get("connection") == "close"
            assert await client.at_eof()


async def test_http10_closes_after_the_response() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(b"GET / HTTP/1.0\r\n\r\n")
            data = await client.read_to_eof()
            assert data.startswith(b"HTTP/1.1 200")


async def test_idle_keep_alive_connection_is_closed(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(LIMITS.idle_timeout + 10):
        async with running() as (port, _), connect(port) as client:
            await client.send(get())
            assert (await client.response())[0] == 200
            before = trio.current_time()
            assert await client.at_eof()
            assert trio.current_time() - before >= LIMITS.idle_timeout


async def test_slow_headers_get_408_then_close(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(LIMITS.header_timeout + 10):
        async with running() as (port, _), connect(port) as client:
            await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
            status, _, body = await client.response()
            assert status == 408
            assert envelope(body)["code"] == "request_timeout"
            assert await client.at_eof()


async def test_slow_body_gets_408(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(LIMITS.body_timeout + 10):
        async with running() as (port, _), connect(port) as client:
            await client.send(post(b"abc")[:-2])  # two bytes short
            status, _, body = await client.response(b"POST")
            assert status == 408
            assert envelope(body)["code"] == "request_timeout"


async def test_huge_headers_get_431() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(get("/", f"X-Big: {'a' * 5000}\r\n"))
            status, _, body = await client.response()
            assert status == 431
            assert envelope(body)["code"] == "headers_too_large"


async def test_content_length_over_limit_gets_413_without_reading_the_body() -> None:
    reached = False

    async def handler(request: Request, responder: Responder) -> None:
        nonlocal reached
        reached = True

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
            status, headers, body = await client.response(b"POST")
            assert status == 413
            assert headers["connection"] == "close"
            assert envelope(body)["code"] == "request_too_large"
            assert await client.at_eof()
    assert not reached


async def test_chunked_body_over_limit_gets_413() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            chunk = b"200\r\n" + b"a" * 0x200 + b"\r\n"
            await client.send(head + chunk * 3)  # 1536 bytes > 1024
            status, _, body = await client.response(b"POST")
            assert status == 413
            assert envelope(body)["code"] == "request_too_large"


async def test_chunked_body_within_limit_is_assembled() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            await client.send(head + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            status, _, body = await client.response(b"POST")
            assert status == 200
            assert json.loads(body)["body"] == "abcde"


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ],
)
async def test_malformed_http_gets_400_envelope(raw: bytes) -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(raw)
            status, headers, body = await client.response()
            assert status == 400
            assert headers["content-type"] == "application/json"
            error = envelope(body)
            assert error["code"] == "invalid_request_error"
            assert "Traceback" not in str(error["message"])
            assert await client.at_eof()


async def test_pipelined_requests_are_answered_in_order() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(get("/1") + post(b"two", "/2") + get("/3"))
            paths = []
            for method in (b"GET", b"POST", b"GET"):
                status, _, body = await client.response(method)
                assert status == 200
                paths.append(json.loads(body)["path"])
            assert paths == ["/1", "/2", "/3"]


async def test_a_request_arriving_as_a_handler_ends_is_read_by_the_next_one() -> None:
    """The next request's bytes arrive in the scheduler round in which the
    handler ends: the watcher (woken by them) or the request loop (taking
    the socket back) reads them, never neither.  The handler writes the
    next request from the client's socket itself and yields once, so both
    orders of that round occur over the iterations."""
    client_fd: list[int] = []

    async def handler(request: Request, responder: Responder) -> None:
        await responder.send(200, [], request.path.encode())
        n = int(request.path[1:])
        if n < 40:
            os.write(client_fd[0], get(f"/{n + 1}"))  # (a small write: all taken)
            await trio.lowlevel.checkpoint()

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            client_fd.append(client.stream.socket.fileno())
            await client.send(get("/0"))
            for n in range(41):
                status, _, body = await client.response()
                assert status == 200 and body == f"/{n}".encode()


async def test_expect_100_continue() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
            )
            interim = await client.stream.receive_some(65536)
            assert interim.startswith(b"HTTP/1.1 100 ")
            client.parser.receive_data(interim)
            await client.send(b"ping")
            status, _, body = await client.response(b"POST")
            assert status == 200 and json.loads(body)["body"] == "ping"


async def test_long_streaming_response_is_never_cut(autojump_clock: trio.abc.Clock) -> None:
    chunks = 200

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/short":
            await responder.send(200, [], b"ok")
            return
        await responder.start(200, [("content-type", "text/event-stream")])
        for i in range(chunks):
            await trio.sleep(10)  # 2000 s in all: far beyond every limit
            await responder.write(f"data: {i}\n\n".encode())
        await responder.end()

    with trio.fail_after(chunks * 10 + 60):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            status, headers, body = await client.response()
            assert status == 200
            assert headers["transfer-encoding"] == "chunked"
            assert body == b"".join(f"data: {i}\n\n".encode() for i in range(chunks))
            # and the connection is still usable afterwards
            await client.send(get("/short"))
            assert (await client.response())[0] == 200


async def test_client_disconnect_cancels_the_handler() -> None:
    entered = trio.Event()
    cleaned_up = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        try:
            entered.set()
            await trio.sleep_forever()
        finally:
            cleaned_up.set()

    with trio.fail_after(10):
        async with running(handler) as (port, server):
            async with connect(port) as client:
                await client.send(get())
                await entered.wait()
                assert server.in_flight == 1
            await cleaned_up.wait()
            await server.wait_idle()
            assert server.in_flight == 0


async def test_client_disconnect_during_streaming_cancels_the_handler() -> None:
    cleaned_up = trio.Event()
    first_sent = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        try:
            await responder.start(200, [("content-type", "text/event-stream")])
            await responder.write(b"data: 1\n\n")
            first_sent.set()
            while True:
                await trio.sleep(0.01)
                await responder.write(b"data: more\n\n")
        finally:
            cleaned_up.set()

    with trio.fail_after(10):
        async with running(handler) as (port, _):
            async with connect(port) as client:
                await client.send(get())
                await first_sent.wait()
            await cleaned_up.wait()


async def test_handler_exception_gets_generic_500() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        raise ValueError("secret-internal-detail sk-123")

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            status, _, body = await client.response()
            assert status == 500
            error = envelope(body)
            assert error["type"] == "server_error"
            assert b"secret-internal-detail" not in body
            assert b"Traceback" not in body
            assert b"ValueError" not in body


async def test_handler_gateway_error_is_rendered_with_its_status() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        raise QueueTimeout("queue timeout", retry_after=3)

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            status, headers, body = await client.response()
            assert status == 503
            assert headers["retry-after"] == "3"
            assert envelope(body)["code"] == "queue_timeout"


async def test_handler_exception_after_start_closes_the_connection() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(200, [])
        await responder.write(b"partial")
        raise RuntimeError("boom")

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            data = await client.read_to_eof()
            assert b"partial" in data
            assert not data.endswith(b"0\r\n\r\n")  # no terminating chunk


async def test_handler_without_response_gets_500_and_unended_stream_is_ended() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/stream":
            await responder.start(200, [])
            await responder.write(b"abc")

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get("/none"))
            assert (await client.response())[0] == 500
            await client.send(get("/stream"))
            status, _, body = await client.response()
            assert status == 200 and body == b"abc"


async def test_write_after_disconnect_raises_client_disconnected() -> None:
    seen: list[BaseException] = []
    done = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(200, [])
        try:
            with trio.CancelScope(shield=True):
                for _ in range(1000):
                    await trio.sleep(0.005)
                    await responder.write(b"x" * 65536)
        except ClientDisconnected as exc:
            seen.append(exc)
        finally:
            done.set()

    with trio.fail_after(20):
        async with running(handler) as (port, _):
            async with connect(port) as client:
                await client.send(get())
                await client.stream.receive_some(10)
            await done.wait()
    assert seen and isinstance(seen[0], ClientDisconnected)


async def test_disallowed_peer_is_closed_immediately() -> None:
    reached = False

    async def handler(request: Request, responder: Responder) -> None:
        nonlocal reached
        reached = True

    with trio.fail_after(10):
        async with (
            running(handler, allow_peer=lambda ip: ip != "127.0.0.1") as (port, _),
            connect(port) as client,
        ):
            try:
                await client.send(get())
            except trio.BrokenResourceError:
                pass
            assert await client.at_eof()
    assert not reached


async def test_head_request_has_no_body() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = await client.response(b"HEAD")
            assert status == 200 and body == b""
            assert int(headers["content-length"]) > 0
            await client.send(get())
            assert (await client.response())[0] == 200


async def test_graceful_shutdown_drains_in_flight_and_closes_idle() -> None:
    release = trio.Event()
    entered = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/slow":
            entered.set()
            await release.wait()
        await responder.send(200, [], b"done")

    shutdown = trio.Event()
    returned = trio.Event()

    async def run_server(task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        await serve_http(
            handler,
            "127.0.0.1",
            0,
            limits=LIMITS,
            render_error=render_error,
            shutdown=shutdown,
            task_status=task_status,
        )
        returned.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(run_server)
            async with connect(port) as idle, connect(port) as busy:
                await idle.send(get())
                assert (await idle.response())[0] == 200
                await busy.send(get("/slow"))
                await entered.wait()
                shutdown.set()
                assert await idle.at_eof()  # the idle keep-alive connection is closed
                with pytest.raises(OSError):
                    await trio.open_tcp_stream("127.0.0.1", port)  # no longer accepting
                assert not returned.is_set()
                release.set()
                status, headers, body = await busy.response()
                assert status == 200 and body == b"done"
                assert headers["connection"] == "close"
                assert await busy.at_eof()
            await returned.wait()


async def test_one_bad_client_does_not_take_the_server_down() -> None:
    with trio.fail_after(10):
        async with running() as (port, _):
            for raw in (b"\x00\xff\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n"):
                async with connect(port) as bad:
                    await bad.send(raw)
            async with connect(port) as good:
                await good.send(get())
                assert (await good.response())[0] == 200


async def test_pipelined_bytes_beyond_the_buffer_cap_are_backpressured_not_lost() -> None:
    release = trio.Event()
    seen: list[int] = []

    async def handler(request: Request, responder: Responder) -> None:
        if not seen:
            await release.wait()
        seen.append(len(request.body))
        await responder.send(200, [], str(len(request.body)).encode())

    limits = HttpLimits(
        max_body_bytes=200_000,
        max_header_bytes=2048,
        header_timeout=5,
        body_timeout=5,
        idle_timeout=5,
    )
    bodies = [b"a" * 10, b"b" * 150_000, b"c" * 150_000, b"d" * 5]
    with trio.fail_after(10):
        async with running(handler, limits) as (port, server), connect(port) as client:
            async with trio.open_nursery() as nursery:
                # 300 kB pipelined behind a blocked handler: more than the
                # server buffers (PIPELINE_BUFFER_CAP), the rest waits in TCP.
                nursery.start_soon(client.send, b"".join(post(b) for b in bodies))
                await trio.sleep(0.2)
                assert server.watched_sockets == 0  # at the cap: no longer read
                release.set()
                sizes = []
                for _ in bodies:
                    status, _, body = await client.response(b"POST")
                    assert status == 200
                    sizes.append(int(body))
            assert sizes == [len(b) for b in bodies] == seen


async def test_the_client_watch_holds_each_running_handler_and_nothing_after() -> None:
    """A socket is watched exactly while its handler runs: answered, pipelined
    behind, or cancelled by its client going away, the watch ends empty."""
    started, all_cancelled = trio.Event(), trio.Event()
    cancelled: list[str] = []
    blocked = 0

    async def handler(request: Request, responder: Responder) -> None:
        nonlocal blocked
        if request.path == "/block":
            blocked += 1
            if blocked == 3:
                started.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                cancelled.append(request.path)
                if len(cancelled) == 3:
                    all_cancelled.set()
                raise
        await responder.send(200, [], b"ok")

    with trio.fail_after(10):
        async with running(handler) as (port, server):
            async with connect(port) as quick:
                for _ in range(3):  # answered, one after the other
                    await quick.send(b"GET /q HTTP/1.1\r\nHost: x\r\n\r\n")
                    assert (await quick.response())[0] == 200
                await quick.send(b"GET /q HTTP/1.1\r\nHost: x\r\n\r\n" * 2)  # pipelined
                assert (await quick.response())[0] == 200
                assert (await quick.response())[0] == 200
                assert server.watched_sockets == 0
                blockers = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
                for stream in blockers:
                    await stream.send_all(b"GET /block HTTP/1.1\r\nHost: x\r\n\r\n")
                await started.wait()
                assert server.watched_sockets == 3  # one per running handler
                for stream in blockers:
                    await stream.aclose()  # EOF: the watch cancels each handler
                await all_cancelled.wait()
                assert server.watched_sockets == 0  # each left the watch before its cancel
                assert cancelled == ["/block"] * 3
                assert server.open_connections == 1  # the quick client's
            await trio.sleep(0.05)
            assert server.watched_sockets == 0 and server.in_flight == 0


async def test_body_arriving_in_pieces_is_assembled() -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            raw = post(b"0123456789")
            for i in range(0, len(raw), 7):
                await client.send(raw[i : i + 7])
                await trio.sleep(0.01)
            status, _, body = await client.response(b"POST")
            assert status == 200 and json.loads(body)["body"] == "0123456789"


async def test_shutdown_lets_a_request_still_being_read_finish() -> None:
    with trio.fail_after(10):
        async with running() as (port, server), connect(port) as client:
            raw = post(b"0123456789")
            await client.send(raw[:-4])
            await trio.testing.wait_all_tasks_blocked()
            assert server.in_flight == 1  # counted from its first byte
            server.shutdown()
            await client.send(raw[-4:])
            status, headers, body = await client.response(b"POST")
            assert status == 200 and json.loads(body)["body"] == "0123456789"
            assert headers["connection"] == "close"
            assert await client.at_eof()
            await server.wait_idle()
            assert server.in_flight == 0


async def test_no_content_length_on_204() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.send(204, [], b"")

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            status, headers, body = await client.response()
            assert status == 204 and body == b"" and "content-length" not in headers


# ------------------------------------------------ response rendering (no h11 on the way out)


@pytest.mark.parametrize(
    ("name", "value"),
    [("x-relayed", "a\r\nset-cookie: evil=1"), ("x-relayed", "a\nb"), ("bad name", "v"),
     ("x-nul", "a\x00b")],
)
async def test_a_header_that_would_split_the_response_is_refused(name: str, value: str) -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(200, [("content-type", "text/plain"), (name, value)])
        await responder.write(b"never")

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            status, headers, body = await client.response()
            assert status == 500
            assert "set-cookie" not in headers and b"never" not in body


async def test_streamed_head_drops_the_handlers_framing_headers() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(
            200,
            [("content-type", "text/event-stream"), ("Content-Length", "3"),
             ("Transfer-Encoding", "gzip"), ("Connection", "upgrade")],
        )
        await responder.write(b"data: 1\n\n")
        await responder.write(b"data: 2\n\n")
        await responder.end()

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(get())
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                raw += await client.stream.receive_some(65536)
            head, _, body = raw.partition(b"\r\n\r\n")
            lines = head.lower().split(b"\r\n")
            assert lines[0] == b"http/1.1 200 ok"
            assert b"transfer-encoding: chunked" in lines
            assert not any(line.startswith((b"content-length", b"connection")) for line in lines)
            assert body == b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
            # still keep-alive: a second request on the same connection is answered
            await client.send(get())
            client.parser = h11.Connection(h11.CLIENT)
            status, _, _ = await client.response()
            assert status == 200


async def test_http10_stream_is_close_delimited() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(200, [("content-type", "text/event-stream")])
        await responder.write(b"data: 1\n\n")
        await responder.end()

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            await client.send(b"GET / HTTP/1.0\r\n\r\n")
            data = await client.read_to_eof()
            head, _, body = data.partition(b"\r\n\r\n")
            assert b"transfer-encoding" not in head.lower()
            assert b"connection: close" in head.lower()
            assert body == b"data: 1\n\n"


async def test_a_write_cut_halfway_ends_the_response_it_never_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A streamed write interrupted mid-piece (slow reader + the handler's own
    deadline) leaves half a chunk on the wire: nothing may follow it, or the
    caller's framing is garbage.  The connection is closed instead."""
    outcome: list[str] = []

    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(200, [("content-type", "text/event-stream")])
        with trio.move_on_after(0.5):
            while True:  # the client does not read: the socket fills up
                await responder.write(b"x" * 65536)
        try:
            await responder.write(b"data: error-after-cut\n\n")
            await responder.end()
            outcome.append("wrote")
        except AbortResponse:
            outcome.append("aborted")
            raise

    with trio.fail_after(10):
        async with running(handler) as (port, _), connect(port) as client:
            client.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await client.send(get())
            await trio.sleep(1)  # let the handler hit its deadline mid-write
            received = bytearray()
            with trio.move_on_after(3):
                while chunk := await client.stream.receive_some(1 << 20):
                    received += chunk
            assert outcome == ["aborted"]
            assert b"error-after-cut" not in received
            assert not received.endswith(b"0\r\n\r\n")  # no clean end after a torn piece


@pytest.mark.parametrize(
    "raw",
    [
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Le",  # closed inside the head
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nshort",  # inside the body
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
    ],
)
async def test_a_client_that_closes_inside_its_request_gets_a_400(raw: bytes) -> None:
    with trio.fail_after(10):
        async with running() as (port, _), connect(port) as client:
            await client.send(raw)
            await client.stream.send_eof()
            data = await client.read_to_eof()
            assert data.startswith(b"HTTP/1.1 400 ")
            assert b'"invalid_request_error"' in data


# ------------------------------------------------------- decide from the head


class _Admitted(HeadContext):
    """What ``_token_check`` returns: the path it admitted."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path


def _token_check(method: str, path: str, headers: list[tuple[str, str]]) -> _Admitted:
    """A head hook like the OpenAI listener's: one route, one method, one token."""
    if path != "/in":
        raise RouteNotFound(f"no route for {method} {path}")
    if method != "POST":
        raise MethodNotAllowed(f"{method} is not allowed on {path}")
    if ("authorization", "Bearer good") not in headers:
        raise AuthenticationError("invalid token")
    return _Admitted(path)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /in HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", 401),
        (b"POST /in HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer bad\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n", 401),
        (b"POST /nope HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\n"
         b"Content-Length: 1000\r\n\r\n", 404),
        (b"PUT /in HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\n"
         b"Content-Length: 1000\r\n\r\n", 405),
    ],
)
async def test_a_head_the_hook_refuses_is_answered_without_its_body(head: bytes, status: int) -> None:
    """No body byte is waited for: the answer comes from the head, then the close.
    Counted by the hook, so ``on_reject`` is not called for it."""
    reached: list[Request] = []
    rejected: list[int] = []

    async def handler(request: Request, responder: Responder) -> None:
        reached.append(request)

    with trio.fail_after(10):
        async with (
            running(
                handler,
                head_check=_token_check,
                on_reject=lambda status, exc, ctx: rejected.append(status),
            ) as (port, server),
            connect(port) as client,
        ):
            await client.send(head)  # and never the body it announces
            got, headers, body = await client.response(b"POST")
            assert got == status
            assert headers["connection"] == "close"
            assert envelope(body)["code"]
            assert await client.at_eof()
            assert server.inflight_body_bytes == 0
    assert reached == [] and rejected == []


async def test_expect_100_continue_only_after_the_head_passed() -> None:
    """A refused caller gets its 401, never ``100 Continue``; an admitted one gets
    ``100 Continue``, and the handler sees what the hook decided."""
    contexts: list[HeadContext | None] = []

    async def handler(request: Request, responder: Responder) -> None:
        contexts.append(request.context)
        await responder.send(200, [], request.body)

    expect = "Content-Length: 4\r\nExpect: 100-continue\r\n"
    with trio.fail_after(10):
        async with running(handler, head_check=_token_check) as (port, _):
            async with connect(port) as client:
                await client.send(f"POST /in HTTP/1.1\r\nHost: x\r\n{expect}\r\n".encode())
                first = await client.stream.receive_some(65536)
                assert first.startswith(b"HTTP/1.1 401 ")
                assert b" 100 " not in first
            async with connect(port) as client:
                auth = "Authorization: Bearer good\r\n"
                await client.send(f"POST /in HTTP/1.1\r\nHost: x\r\n{auth}{expect}\r\n".encode())
                interim = await client.stream.receive_some(65536)
                assert interim.startswith(b"HTTP/1.1 100 ")
                client.parser.receive_data(interim)
                await client.send(b"ping")
                status, _, body = await client.response(b"POST")
                assert status == 200 and body == b"ping"
    assert [c.path if isinstance(c, _Admitted) else c for c in contexts] == ["/in"]


async def test_a_head_hook_that_crashes_is_a_500_not_a_dead_server() -> None:
    def broken(method: str, path: str, headers: list[tuple[str, str]]) -> object:
        raise RuntimeError("bug")

    with trio.fail_after(10):
        async with running(head_check=broken) as (port, _):
            for _ in range(2):
                async with connect(port) as client:
                    await client.send(get())
                    status, _, body = await client.response()
                    assert status == 500 and b"bug" not in body


# ------------------------------------------------------------- connections


async def test_past_max_connections_new_ones_wait_to_be_accepted() -> None:
    """At the limit the server stops accepting: a third connection is answered
    only once one of the first two has closed."""
    limits = HttpLimits(max_connections=2, idle_timeout=60)
    with trio.fail_after(10):
        async with running(limits=limits) as (port, server):
            async with connect(port) as first, connect(port) as second:
                for client in (first, second):
                    await client.send(get())
                    assert (await client.response())[0] == 200
                assert server.open_connections == 2
                async with connect(port) as third:  # the kernel completes the handshake
                    await third.send(get("/third"))
                    with trio.move_on_after(0.5):
                        await third.stream.receive_some(65536)
                        raise AssertionError("a connection past max_connections was served")
                    assert server.open_connections == 2
                    await first.stream.aclose()
                    status, _, body = await third.response()
                    assert status == 200 and json.loads(body)["path"] == "/third"


# ----------------------------------------------------- in-flight body bytes

BUDGET = HttpLimits(max_body_bytes=1024, max_inflight_body_bytes=1500, body_timeout=5.0)


async def test_a_body_past_the_inflight_budget_gets_503_overloaded_then_the_budget_returns() -> None:
    rejected: list[tuple[int, str]] = []

    with trio.fail_after(10):
        async with running(
            limits=BUDGET, on_reject=lambda status, exc, ctx: rejected.append((status, exc.code))
        ) as (port, server):
            async with connect(port) as slow, connect(port) as late:
                await slow.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")
                await wait_for(lambda: server.inflight_body_bytes == 1000)
                # A second 1000-byte body would hold 2000 > 1500 bytes: refused from its head.
                await late.send(
                    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                    b"Expect: 100-continue\r\n\r\n"
                )
                status, headers, body = await late.response(b"POST")
                assert status == 503
                assert headers["retry-after"] == "1"
                error = envelope(body)
                assert error["code"] == "overloaded" and error["type"] == "server_error"
                assert await late.at_eof()
                # A small one still fits.
                async with connect(port) as small:
                    await small.send(post(b"x" * 400))
                    assert (await small.response(b"POST"))[0] == 200
                await slow.send(b"c" * 998)
                status, _, body = await slow.response(b"POST")
                assert status == 200 and len(json.loads(body)["body"]) == 1000
            assert server.inflight_body_bytes == 0
    assert rejected == [(503, "overloaded")]


async def test_chunked_bodies_are_counted_as_they_arrive() -> None:
    with trio.fail_after(10):
        async with running(limits=BUDGET) as (port, server):
            async with connect(port) as one, connect(port) as two:
                head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                await one.send(head + b"3e8\r\n" + b"a" * 1000 + b"\r\n")
                await wait_for(lambda: server.inflight_body_bytes == 1000)
                await two.send(head + b"258\r\n" + b"b" * 600 + b"\r\n")
                status, _, body = await two.response(b"POST")
                assert status == 503 and envelope(body)["code"] == "overloaded"
                await one.send(b"0\r\n\r\n")
                assert (await one.response(b"POST"))[0] == 200
            assert server.inflight_body_bytes == 0


async def _body_then(port: int, server: HttpServer, end: Callable[[Client], Awaitable[None]]) -> None:
    """Start a 1000-byte body, check it is reserved, finish the scenario with ``end``."""
    async with connect(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab")
        await wait_for(lambda: server.inflight_body_bytes == 1000)
        await end(client)
    await wait_for(lambda: server.inflight_body_bytes == 0)


async def test_the_inflight_budget_returns_to_zero_on_every_path(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Success, a handler error, a client gone mid-body, a body timeout, a body
    over the size limit, a cancelled server: each gives its reservation back."""

    async def handler(request: Request, responder: Responder) -> None:
        if request.body.startswith(b"boom"):
            raise RuntimeError("handler bug")
        await responder.send(200, [], b"ok")

    async def finish_ok(client: Client) -> None:
        await client.send(b"c" * 998)
        assert (await client.response(b"POST"))[0] == 200

    async def go_away(client: Client) -> None:
        await client.stream.aclose()

    async def stay_silent(client: Client) -> None:
        assert (await client.response(b"POST"))[0] == 408

    with trio.fail_after(60):
        async with running(handler, limits=BUDGET) as (port, server):
            for end in (finish_ok, go_away, stay_silent):
                await _body_then(port, server, end)
            async with connect(port) as client:  # boom: a 500 after the body is in
                await client.send(post(b"boom" + b"x" * 600))
                assert (await client.response(b"POST"))[0] == 500
            assert server.inflight_body_bytes == 0
            async with connect(port) as client:  # chunked past max_body_bytes: 413
                head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                await client.send(head + b"3e8\r\n" + b"a" * 1000 + b"\r\n")
                await wait_for(lambda: server.inflight_body_bytes == 1000)
                await client.send(b"64\r\n" + b"a" * 100 + b"\r\n")
                assert (await client.response(b"POST"))[0] == 413
            assert server.inflight_body_bytes == 0
        # The server cancelled while a body was arriving.
        async with trio.open_nursery() as nursery:
            server = HttpServer(echo_handler, limits=BUDGET, render_error=render_error)
            _, port = await nursery.start(server.serve, "127.0.0.1", 0)
            async with connect(port) as client:
                await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
                await wait_for(lambda: server.inflight_body_bytes == 1000)
                nursery.cancel_scope.cancel()
        assert server.inflight_body_bytes == 0


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Poll server state until ``predicate`` holds (callers bound it with ``fail_after``)."""
    while not predicate():  # noqa: ASYNC110 - polling state owned by other tasks
        await trio.sleep(0.001)


# ------------------------------------------------------------- send timeout


async def test_a_reader_that_stops_reading_is_cut_after_send_timeout() -> None:
    """No byte taken for ``send_timeout``: the connection is cut and the handler
    cancelled (whatever it holds, it lets go)."""
    outcome: list[str] = []
    limits = HttpLimits(send_timeout=0.3)

    async def handler(request: Request, responder: Responder) -> None:
        try:
            await responder.start(200, [("content-type", "text/event-stream")])
            while True:
                await responder.write(b"x" * 65536)
        except trio.Cancelled:
            outcome.append("cancelled")
            raise
        except ClientDisconnected:
            outcome.append("disconnected")
            raise

    with trio.fail_after(20):
        async with running(handler, limits=limits) as (port, server):
            async with connect(port) as client:
                client.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                await client.send(get())
                await wait_for(lambda: server.in_flight == 1)
                await wait_for(lambda: server.in_flight == 0)  # never read, and yet it ends
    assert outcome == ["disconnected"]


async def test_a_slow_reader_that_keeps_reading_is_never_cut() -> None:
    """The timer restarts whenever the caller's TCP takes bytes: a response whose
    write waits on the reader far longer than ``send_timeout`` in all, but keeps
    moving, is complete.  (Real time: the kernel's window updates are.)"""
    size = 4 * 1024 * 1024
    limits = HttpLimits(send_timeout=1.0)
    took: list[float] = []

    async def handler(request: Request, responder: Responder) -> None:
        started = trio.current_time()
        await responder.send(200, [], b"y" * size)
        took.append(trio.current_time() - started)

    with trio.fail_after(60):
        async with running(handler, limits=limits) as (port, _):
            async with connect(port) as client:
                client.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 18)
                await client.send(get("/", "Connection: close\r\n"))
                received = 0
                while chunk := await client.stream.receive_some(65536):
                    received += len(chunk)
                    await trio.sleep(0.05)  # ~1.3 MB/s
                assert received > size
    assert took and took[0] > 2 * limits.send_timeout


async def test_a_write_from_another_task_the_socket_took_in_part_is_finished_first() -> None:
    """``Responder.flush_nowait`` (the relay's wire reader writing what it
    held): when the kernel takes only part, the rest leaves with the
    handler's next write, before it (or alone, by ``send_unsent``), so the
    caller reads every byte in order; while a part waits nothing more is
    written without awaiting (it stays held for ``flush``); an idle socket
    takes a small piece at once."""
    big = bytes(range(256)) * (16 * 1024)  # 4 MiB: more than the socket takes at once
    results: list[tuple[bool, bool]] = []

    def write_held(responder: Responder, data: bytes) -> None:
        responder.write_held(data)
        results.append((responder.flush_nowait(), responder.unsent))

    async def handler(request: Request, responder: Responder) -> None:
        await responder.start(200, [("content-type", "text/event-stream")])
        write_held(responder, big)
        await responder.write(b"tail")  # the rest of ``big`` first
        write_held(responder, big)
        write_held(responder, b"held")  # a part waits: not written, kept
        await responder.send_unsent()
        await responder.flush()
        write_held(responder, b"small")
        await responder.end()

    with trio.fail_after(30):
        async with running(handler) as (port, _):
            async with connect(port) as client:
                client.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
                await client.send(get())
                await trio.sleep(0.1)  # let the socket buffers fill
                status, _headers, body = await client.response()
    assert status == 200
    assert body == big + b"tail" + big + b"held" + b"small"
    assert results == [(True, True), (True, True), (False, True), (True, False)]
