"""The admin listener on quart-trio + hypercorn: the framework pitfalls.

Each test serves ``create_admin_app`` with ``AdminServer`` on port 0, with
small configured timeouts, and talks to it over a raw socket: the lifespan
runs (and a failing startup is one line), a streaming route outlives the
framework's timeouts, ``Connection: close`` and shutdown close the socket, a
client's disconnect reaches the streaming handler, and nothing reaches the
log as a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import pytest
import trio
from quart import Response
from quart_trio import QuartTrio

from iopd.config.load import parse_edge_config
from iopd.edge.admin import create_admin_app
from iopd.edge.admin.routes import MAX_BODY_BYTES
from iopd.edge.admin.serve import AdminLimits, AdminServer, _is_event_stream, hypercorn_config
from iopd.edge.admin.streaming import streaming_response
from iopd.edge.runtime.edge_runtime import EdgeRuntime
from iopd.startup import StartupError
from tests.support.admin import two_node_yaml

#: Small, so that a stream of a few 0.1 s gaps outlives them several times over.
FAST = AdminLimits(keep_alive_timeout=0.1, graceful_timeout=0.2, lifespan_timeout=2)
CHUNKS = 6
GAP = 0.1


def admin_app() -> QuartTrio:
    return create_admin_app(EdgeRuntime.create(parse_edge_config(two_node_yaml(), env={})))


async def serve(
    nursery: trio.Nursery, app: QuartTrio, limits: AdminLimits = FAST
) -> tuple[AdminServer, tuple[str, int]]:
    server = AdminServer(app, limits=limits)
    bound: tuple[str, int] = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, bound


def head(method: str, path: str, *extra: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", *extra, "", ""]
    return "\r\n".join(lines).encode()


async def read_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, f"closed before {marker!r}: {data!r}"
        data += chunk
    return data


async def read_until_eof(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


async def get_and_close(addr: tuple[str, int], path: str) -> bytes:
    """The whole reply to ``GET path`` sent with ``Connection: close``."""
    stream = await trio.open_tcp_stream(*addr)
    await stream.send_all(head("GET", path, "connection: close"))
    return await read_until_eof(stream)


async def serve_one_get(app: QuartTrio, path: str) -> bytes:
    """Serve ``app`` with ``FAST`` limits for one ``GET path``; its whole reply."""
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, addr = await serve(nursery, app)
            data = await get_and_close(addr, path)
            server.shutdown()
    return data


def add_stream_route(
    app: QuartTrio, make: Callable[[AsyncIterator[bytes]], Response], ended: trio.Event
) -> None:
    """``GET /test-stream``: CHUNKS chunks GAP seconds apart; ``ended`` when its generator ends."""

    async def chunks() -> AsyncIterator[bytes]:
        try:
            for i in range(CHUNKS):
                yield f"data: {i}\n\n".encode()
                await trio.sleep(GAP)
        finally:
            ended.set()

    async def stream_route() -> Response:
        return make(chunks())

    app.add_url_rule("/test-stream", view_func=stream_route, methods=["GET"])


def plain(chunks: AsyncIterator[bytes]) -> Response:
    return Response(chunks, content_type="text/event-stream")


def helper(chunks: AsyncIterator[bytes]) -> Response:
    return streaming_response(chunks, content_type="text/event-stream")


# ------------------------------------------------------------------ lifespan


async def test_lifespan_startup_and_shutdown_run() -> None:
    app = admin_app()
    seen: list[str] = []

    @app.before_serving
    async def started() -> None:
        seen.append("startup")

    @app.after_serving
    async def stopped() -> None:
        seen.append("shutdown")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, addr = await serve(nursery, app)
            assert seen == ["startup"]
            assert b'{"status":"ok"}' in await get_and_close(addr, "/healthz")
            server.shutdown()
            await server.stopped.wait()
        assert seen == ["startup", "shutdown"]


async def test_a_failing_startup_is_one_line() -> None:
    app = admin_app()

    @app.before_serving
    async def broken() -> None:
        raise RuntimeError("the console's templates are missing")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            with pytest.raises(StartupError) as info:
                await serve(nursery, app)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("admin app failed on 127.0.0.1:")
    assert "startup: the console's templates are missing" in message


# ------------------------------------------------------------------ streaming


async def test_the_admin_app_has_no_response_timeout() -> None:
    """A stream outlives hypercorn's keep-alive timeout several times over, whole."""
    app = admin_app()
    assert app.config["RESPONSE_TIMEOUT"] is None  # Quart's default is 60 s
    ended = trio.Event()
    add_stream_route(app, plain, ended)
    data = await serve_one_get(app, "/test-stream")
    assert all(f"data: {i}\n\n".encode() in data for i in range(CHUNKS))
    assert data.endswith(b"0\r\n\r\n")  # the chunked body's proper end


@pytest.mark.parametrize(("make", "whole"), [(helper, True), (plain, False)])
async def test_streaming_response_ignores_a_response_timeout(
    make: Callable[[AsyncIterator[bytes]], Response], whole: bool
) -> None:
    """With Quart's cut on (scaled down to 0.15 s), only ``streaming_response`` runs to its end."""
    app = admin_app()
    app.config["RESPONSE_TIMEOUT"] = 0.15
    ended = trio.Event()
    add_stream_route(app, make, ended)
    data = await serve_one_get(app, "/test-stream")
    assert (f"data: {CHUNKS - 1}\n\n".encode() in data) is whole


# ------------------------------------------------------------- connections


async def test_connection_close_closes_the_socket() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, addr = await serve(nursery, admin_app(), AdminLimits(keep_alive_timeout=60))
            for path in ("/status", "/nope"):
                # EOF well before the 60 s keep-alive timeout: the server closed it.
                data = await get_and_close(addr, path)
                assert data.startswith((b"HTTP/1.1 200", b"HTTP/1.1 404"))
            server.shutdown()


async def test_keep_alive_serves_a_second_request_then_times_out() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, addr = await serve(nursery, admin_app())
            stream = await trio.open_tcp_stream(*addr)
            await stream.send_all(head("GET", "/healthz") + head("GET", "/healthz"))
            data = await read_until(stream, b'{"status":"ok"}')
            if data.count(b'{"status":"ok"}') < 2:
                await read_until(stream, b'{"status":"ok"}')
            assert await read_until_eof(stream) == b""  # closed by the 0.1 s idle timeout
            server.shutdown()


async def test_shutdown_closes_idle_keep_alive_connections_and_ends_streams() -> None:
    """An idle keep-alive connection does not hold shutdown; a stream gets graceful_timeout."""
    app = admin_app()
    ended = trio.Event()
    add_stream_route(app, plain, ended)
    limits = AdminLimits(keep_alive_timeout=60, graceful_timeout=0.2)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, addr = await serve(nursery, app, limits)
            idle = await trio.open_tcp_stream(*addr)
            await idle.send_all(head("GET", "/healthz"))
            await read_until(idle, b'{"status":"ok"}')
            streaming = await trio.open_tcp_stream(*addr)
            await streaming.send_all(head("GET", "/test-stream"))
            await read_until(streaming, b"data: 0")
            server.shutdown()
            await server.stopped.wait()
            assert await read_until_eof(idle) == b""
            await read_until_eof(streaming)  # cut after graceful_timeout, before its end
            assert ended.is_set()
            # Nothing accepts any more.
            with pytest.raises(OSError):
                await trio.open_tcp_stream(*addr)


async def test_a_client_disconnect_cancels_the_streaming_handler() -> None:
    app = admin_app()
    ended = trio.Event()
    add_stream_route(app, helper, ended)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, addr = await serve(nursery, app, AdminLimits(keep_alive_timeout=60))
            stream = await trio.open_tcp_stream(*addr)
            await stream.send_all(head("GET", "/test-stream"))
            await read_until(stream, b"data: 0")
            await stream.aclose()
            await ended.wait()  # the generator's finally ran, long before its last chunk
            server.shutdown()


# ------------------------------------------------------------- bounds and logs


async def test_a_body_over_the_limit_is_a_413_envelope() -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server, addr = await serve(nursery, admin_app())
            stream = await trio.open_tcp_stream(*addr)
            size = MAX_BODY_BYTES + 1
            await stream.send_all(
                head(
                    "POST",
                    "/refresh",
                    "content-type: application/json",
                    f"content-length: {size}",
                    "connection: close",
                )
                + b" " * size
            )
            data = await read_until_eof(stream)
            assert data.startswith(b"HTTP/1.1 413")
            assert b'"code":"request_too_large"' in data
            server.shutdown()


async def test_a_failing_handler_is_a_500_envelope_and_one_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = admin_app()

    async def broken() -> Response:
        raise KeyError("secret-looking detail")

    app.add_url_rule("/test-broken", view_func=broken, methods=["GET"])
    caplog.set_level(logging.DEBUG)
    data = await serve_one_get(app, "/test-broken")
    assert data.startswith(b"HTTP/1.1 500")
    assert b'"type":"server_error"' in data and b"secret-looking" not in data
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "event=admin_error method=GET path='/test-broken' error=KeyError"
    ]
    assert all(r.exc_info is None and r.name.startswith("iopd.") for r in caplog.records)


async def test_access_lines_only_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    for level, expected in ((logging.INFO, 0), (logging.DEBUG, 1)):
        caplog.clear()
        caplog.set_level(level)
        await serve_one_get(admin_app(), "/healthz")
        access = [r for r in caplog.records if r.name == "iopd.edge.admin.access"]
        assert len(access) == expected
        assert not [r for r in caplog.records if r.name.startswith("hypercorn")]


def test_the_limits_become_hypercorns_config() -> None:
    config = hypercorn_config(AdminLimits(max_header_bytes=1024, keep_alive_timeout=2.5))
    assert config.h11_max_incomplete_size == 1024 and config.keep_alive_timeout == 2.5
    assert config.accesslog is None and config.errorlog is None  # iopd's logging only
    assert not config.include_server_header


@pytest.mark.parametrize(
    ("headers", "stream"),
    [
        ([(b"content-type", b"text/event-stream")], True),
        ([(b"Content-Type", b"Text/Event-Stream; charset=utf-8")], True),
        ([(b"content-type", b"application/json")], False),
        ([], False),
    ],
)
def test_an_event_stream_is_known_by_its_content_type(
    headers: list[tuple[bytes, bytes]], stream: bool
) -> None:
    assert _is_event_stream(headers) is stream
