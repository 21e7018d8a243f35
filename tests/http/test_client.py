"""ProviderHTTPClient against the mock servers on real sockets (port 0)."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from iopd.http.client import (
    ProviderConnectError,
    ProviderHTTPClient,
    ProviderProtocolError,
    ProviderTimeoutError,
)
from tests.support.mock_providers import MockOpenAIServer, MockReply


def client_for(openai_mock: MockOpenAIServer, read_timeout: float = 5.0) -> ProviderHTTPClient:
    return ProviderHTTPClient(openai_mock.base_url, connect_timeout=5.0, read_timeout=read_timeout)


def drop_first_request() -> tuple[Callable[[Any], MockReply | None], list[str]]:
    """A mock handler that closes the connection on the first request, without answering."""
    dropped: list[str] = []

    def handler(req: Any) -> MockReply | None:
        if not dropped:
            dropped.append(req.path)
            return MockReply(raw=b"")
        return None

    return handler, dropped


async def test_request_returns_status_headers_and_body(openai_mock: MockOpenAIServer) -> None:
    openai_mock.listed = ["mock-model"]
    with trio.fail_after(5):
        client = client_for(openai_mock)
        resp = await client.request("GET", "/v1/models")
        assert resp.status == 200
        assert ("content-type", "application/json") in resp.headers
        assert json.loads(resp.body)["data"][0]["id"] == "mock-model"
        req = openai_mock.requests[0]
        assert req.header("host") == f"127.0.0.1:{openai_mock.port}"
        await client.aclose()


async def test_keep_alive_reuses_one_connection(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        body = json.dumps({"model": "m", "messages": []}).encode()
        first = await client.request("POST", "/v1/chat/completions", [], body)
        second = await client.request("POST", "/v1/chat/completions", [], body)
        assert first.status == second.status == 200
        assert openai_mock.connections_opened == 1
        assert client.connections_opened == 1
        assert openai_mock.requests[0].header("content-length") == str(len(body))
        await client.aclose()


async def test_streamed_body_arrives_in_pieces_and_is_byte_exact(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        openai_mock.reply_text = "one two three four"
        body = json.dumps({"model": "m", "stream": True}).encode()
        pieces: list[bytes] = []
        async with client.stream("POST", "/v1/chat/completions", [], body) as resp:
            assert resp.status == 200
            assert resp.header("content-type") == "text/event-stream"
            async for chunk in resp.aiter_bytes():
                pieces.append(chunk)
        expected = b"".join(openai_mock._chat({"model": "m", "stream": True}).chunks or [])
        assert b"".join(pieces) == expected
        assert client.idle_connections == 1
        await client.aclose()


async def test_unread_body_closes_connection_instead_of_pooling(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        openai_mock.chunk_delay = 0.05
        body = json.dumps({"model": "m", "stream": True}).encode()
        async with client.stream("POST", "/v1/chat/completions", [], body) as resp:
            async for _ in resp.aiter_bytes():
                break
        assert client.idle_connections == 0
        await openai_mock.wait_client_close(1)
        await client.request("GET", "/v1/models")
        assert openai_mock.connections_opened == 2
        await client.aclose()


async def test_cancel_mid_stream_closes_upstream_connection(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        openai_mock.handler = lambda req: MockReply(
            headers=[("content-type", "text/event-stream")],
            chunks=[b"data: 1\n\n"],
            hang_after_chunks=True,
        )
        got_first = trio.Event()

        async def consume(cancel_scope: trio.CancelScope) -> None:
            with cancel_scope:
                async with client.stream("POST", "/x", [], b"{}") as resp:
                    async for _ in resp.aiter_bytes():
                        got_first.set()

        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume, scope)
            await got_first.wait()
            assert openai_mock.client_closes == 0
            scope.cancel()
        await openai_mock.wait_client_close(1)
        assert openai_mock.client_closes == 1
        assert client.idle_connections == 0


async def test_connection_refused_is_connect_error() -> None:
    with trio.fail_after(5):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        client = ProviderHTTPClient(f"http://127.0.0.1:{port}", connect_timeout=2, read_timeout=2)
        with pytest.raises(ProviderConnectError):
            await client.request("GET", "/")


async def test_hanging_provider_times_out_per_read(
    openai_mock: MockOpenAIServer, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(60):
        client = client_for(openai_mock, read_timeout=10)
        openai_mock.mode = "hang"
        with pytest.raises(ProviderTimeoutError):
            await client.request("GET", "/v1/models")
        await openai_mock.wait_client_close(1)


async def test_slow_stream_within_read_timeout_is_fine(
    openai_mock: MockOpenAIServer, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(120):
        client = client_for(openai_mock, read_timeout=10)
        openai_mock.chunk_delay = 8  # each gap < read_timeout, whole stream > read_timeout
        resp = await client.request("POST", "/v1/chat/completions", [], b'{"stream": true}')
        assert resp.status == 200
        assert resp.body.endswith(b"data: [DONE]\n\n")


async def test_a_stream_that_stops_mid_way_times_out_one_read_timeout_after_its_last_piece(
    openai_mock: MockOpenAIServer, autojump_clock: trio.testing.MockClock
) -> None:
    """The read timeout of a body read (the client's ``ReadWatch``): pieces
    4 s apart pass a 10 s timeout, the wait after the last piece ends at
    exactly 10 s with ``ProviderTimeoutError``, the connection is closed and
    nothing is left waiting."""
    with trio.fail_after(200):
        client = client_for(openai_mock, read_timeout=10)
        openai_mock.chunk_delay = 4
        openai_mock.handler = lambda req: MockReply(
            chunks=[b"one ", b"two ", b"three "], hang_after_chunks=True
        )
        pieces: list[tuple[bytes, float]] = []
        async with client.stream("POST", "/v1/chat/completions", [], b"{}") as resp:
            with pytest.raises(ProviderTimeoutError):
                async for piece in resp.aiter_bytes():
                    pieces.append((piece, trio.current_time()))
            failed_at = trio.current_time()
        assert b"".join(p for p, _ in pieces) == b"one two three "
        assert failed_at - pieces[-1][1] == pytest.approx(10.0, abs=1e-6)
        assert client._watch.waiting == 0
        await openai_mock.wait_client_close(1)
        assert client.idle_connections == 0


async def test_a_provider_that_accepts_and_never_answers_ends_at_first_byte_timeout(
    openai_mock: MockOpenAIServer, autojump_clock: trio.testing.MockClock
) -> None:
    """No head within ``first_byte_timeout``: ``ProviderTimeoutError`` at exactly
    that time (not ``read_timeout``), the connection closed, nothing left waiting."""
    with trio.fail_after(1000):
        client = ProviderHTTPClient(
            openai_mock.base_url, connect_timeout=5, read_timeout=300, first_byte_timeout=60
        )
        openai_mock.mode = "hang"
        started = trio.current_time()
        with pytest.raises(ProviderTimeoutError) as info:
            async with client.stream("POST", "/v1/chat/completions", [], b"{}"):
                pass  # pragma: no cover - no head ever comes
        assert trio.current_time() - started == pytest.approx(60.0, abs=1e-6)
        assert str(info.value) == "the provider sent no response within 60s (first_byte_timeout)"
        assert client._watch.waiting == 0
        await openai_mock.wait_client_close(1)
        assert client.idle_connections == 0
        # Once the answer has begun, only read_timeout counts between its pieces.
        openai_mock.mode = "ok"
        openai_mock.handler = lambda req: MockReply(chunks=[b"one ", b"two "], chunk_delay=100)
        resp = await client.request("POST", "/v1/chat/completions", [], b"{}")
        assert resp.status == 200 and resp.body == b"one two "
        await client.aclose()


async def test_garbage_is_protocol_error(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        openai_mock.mode = "garbage"
        with pytest.raises(ProviderProtocolError):
            await client.request("GET", "/v1/models")


async def test_server_closing_idle_connection_is_retried_transparently(
    openai_mock: MockOpenAIServer,
) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        openai_mock.handler = lambda req: MockReply(body=b"{}", close=False)
        await client.request("GET", "/a")
        assert client.idle_connections == 1
        # The server drops the next request on that connection without answering.
        openai_mock.mode = "drop"
        openai_mock.handler = None
        with pytest.raises(ProviderProtocolError):
            # first attempt reused (stale) -> retried on a fresh one -> dropped again
            await client.request("GET", "/b")
        openai_mock.mode = "ok"
        resp = await client.request("GET", "/v1/models")
        assert resp.status == 200


async def test_error_status_is_returned_not_raised(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        openai_mock.mode = "error500"
        resp = await client.request("GET", "/v1/models")
        assert resp.status == 500
        assert b"boom" in resp.body


async def test_base_url_path_prefix_is_kept(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = ProviderHTTPClient(openai_mock.base_url + "/prefix/", connect_timeout=2, read_timeout=2)
        await client.request("GET", "/v1/models")
        assert openai_mock.requests[-1].path == "/prefix/v1/models"


def test_unsupported_scheme_is_rejected() -> None:
    with pytest.raises(ValueError):
        ProviderHTTPClient("ftp://x", connect_timeout=1, read_timeout=1)


async def test_idle_connection_closed_by_server_is_not_reused(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        openai_mock.handler = lambda req: MockReply(body=b"{}", drop_after=True)
        await client.request("GET", "/a")
        assert client.idle_connections == 1  # nothing told the client it was closed
        await openai_mock.wait_connections_ended(1)
        openai_mock.handler = None
        # the pooled socket is at EOF: detected before reuse, a fresh one is dialled
        resp = await client.request("GET", "/v1/models")
        assert resp.status == 200
        assert client.connections_opened == 2
        assert [r.path for r in openai_mock.requests] == ["/a", "/v1/models"]


async def test_stale_reused_connection_is_retried_once(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        await client.request("GET", "/v1/models")
        openai_mock.handler, dropped = drop_first_request()
        resp = await client.request("GET", "/v1/models")
        assert resp.status == 200
        assert dropped == ["/v1/models"]
        assert client.connections_opened == 2


def _tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for ``localhost`` from a test CA,
    and a client context that trusts that CA."""
    import trustme

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    return server_ctx, client_ctx


async def test_https_with_custom_trust() -> None:
    server_ctx, client_ctx = _tls_contexts()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(MockOpenAIServer(ssl_context=server_ctx).serve)
            client = ProviderHTTPClient(
                server.base_url, connect_timeout=5, read_timeout=5, ssl_context=client_ctx
            )
            for _ in range(2):
                resp = await client.request("GET", "/v1/models")
                assert resp.status == 200
            assert server.connections_opened == 1
            untrusted = ProviderHTTPClient(server.base_url, connect_timeout=5, read_timeout=5)
            with pytest.raises(ProviderConnectError):
                await untrusted.request("GET", "/v1/models")
            await client.aclose()
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------ start_early (early start)


async def test_start_early_needs_an_idle_connection(openai_mock: MockOpenAIServer) -> None:
    openai_mock.listed = ["mock-model"]
    with trio.fail_after(5):
        client = client_for(openai_mock)
        assert client.start_early("GET", "/v1/models") is None  # nothing pooled yet: dial later
        await client.request("GET", "/v1/models")
        started = client.start_early("GET", "/v1/models")
        assert started is not None and client.idle_connections == 0
        # Written already: the mock answers before stream() even sends anything.
        async with client.stream("GET", "/v1/models", early=started) as resp:
            assert resp.status == 200
            body = await resp.read()
        assert json.loads(body)["data"][0]["id"] == "mock-model"
        assert client.connections_opened == 1 and client.idle_connections == 1
        assert [r.path for r in openai_mock.requests] == ["/v1/models", "/v1/models"]
        await client.aclose()


async def test_abandoned_early_start_closes_its_connection(openai_mock: MockOpenAIServer) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        await client.request("GET", "/v1/models")
        started = client.start_early("POST", "/v1/chat/completions", [], b"{}")
        assert started is not None
        started.abandon()
        started.abandon()  # idempotent
        await openai_mock.wait_connections_ended(1)  # the provider sees the request aborted
        assert started.take() is None  # an abandoned start cannot be used any more
        resp = await client.request("GET", "/v1/models")  # a fresh connection serves
        assert resp.status == 200 and client.connections_opened == 2
        await client.aclose()


async def test_an_early_start_of_another_client_is_abandoned_not_used(
    openai_mock: MockOpenAIServer,
) -> None:
    """A registry swap between start_early and the stream: the new adapter's
    client must not read the old client's connection; it closes it at once."""
    with trio.fail_after(5):
        old, new = client_for(openai_mock), client_for(openai_mock)
        await old.request("GET", "/v1/models")
        started = old.start_early("GET", "/v1/models")
        assert started is not None
        async with new.stream("GET", "/v1/models", early=started) as resp:
            assert resp.status == 200
            await openai_mock.wait_connections_ended(1)  # the old connection, before the body
            await resp.read()
        assert started.take() is None
        assert old.connections_opened == 1 and new.connections_opened == 1
        await old.aclose()
        await new.aclose()


async def test_early_start_on_a_connection_the_server_dropped_is_retried(
    openai_mock: MockOpenAIServer,
) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        await client.request("GET", "/v1/models")
        openai_mock.handler, dropped = drop_first_request()
        started = client.start_early("GET", "/v1/models")
        assert started is not None
        async with client.stream("GET", "/v1/models", early=started) as resp:
            assert resp.status == 200
            await resp.read()
        assert dropped == ["/v1/models"] and client.connections_opened == 2
        await client.aclose()


async def test_the_retry_of_a_dropped_early_start_sends_the_headers_once_built(
    openai_mock: MockOpenAIServer,
) -> None:
    """stream() builds the headers only to render the request itself: not for
    the early start it takes, but for that start's retry on a fresh
    connection, from a header iterator that can be read once."""
    with trio.fail_after(5):
        client = client_for(openai_mock)
        await client.request("GET", "/v1/models")
        headers = [("Authorization", "Bearer sk-retry"), ("X-Trace", "t1")]
        started = client.start_early("GET", "/v1/models", headers)
        assert started is not None
        openai_mock.handler, dropped = drop_first_request()
        reads: list[int] = []

        def once() -> Iterator[tuple[str, str]]:
            reads.append(1)
            yield from headers

        async with client.stream("GET", "/v1/models", once(), early=started) as resp:
            assert resp.status == 200
            await resp.read()
        assert dropped == ["/v1/models"] and reads == [1]
        first, retried = openai_mock.requests[-2], openai_mock.requests[-1]
        for req in (first, retried):
            assert req.header("authorization") == "Bearer sk-retry"
            assert req.header("x-trace") == "t1"
        await client.aclose()


async def test_a_taken_start_is_owned_by_stream_even_when_cancelled(
    openai_mock: MockOpenAIServer,
) -> None:
    with trio.fail_after(5):
        client = client_for(openai_mock)
        await client.request("GET", "/v1/models")
        started = client.start_early("GET", "/v1/models")
        assert started is not None
        with trio.CancelScope() as scope:
            scope.cancel()
            async with client.stream("GET", "/v1/models", early=started):
                pass  # pragma: no cover - cancelled before the head arrives
        assert started.take() is None  # stream() took it ...
        await openai_mock.wait_connections_ended(1)  # ... and closed it: not pooled half-read
        assert client.idle_connections == 0
        await client.aclose()


async def test_https_provider_that_hangs_mid_stream_times_out() -> None:
    """Over TLS the read timeout closes the socket under the TLS stream; the
    wait ends as a timeout all the same, not as a broken connection."""
    server_ctx, client_ctx = _tls_contexts()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(MockOpenAIServer(ssl_context=server_ctx).serve)
            server.handler = lambda req: MockReply(chunks=[b"one "], hang_after_chunks=True)
            client = ProviderHTTPClient(
                server.base_url, connect_timeout=5, read_timeout=0.3, ssl_context=client_ctx
            )
            pieces: list[bytes] = []
            async with client.stream("POST", "/v1/chat/completions", [], b"{}") as resp:
                with pytest.raises(ProviderTimeoutError):
                    async for piece in resp.aiter_bytes():
                        pieces.append(piece)
            assert pieces == [b"one "]
            assert client.idle_connections == 0
            nursery.cancel_scope.cancel()
