"""serve_wire: the port it bound, a handler that fails does not stop it."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iopd.transport import serve_wire


async def test_serve_wire_reports_port_and_survives_handler_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    async def handler(stream: trio.abc.Stream) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        await stream.send_all(b"ok")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve_wire, handler, "127.0.0.1", 0)
            assert host == "127.0.0.1" and port > 0
            first = await trio.open_tcp_stream(host, port)
            assert await first.receive_some(10) == b""  # closed after the error
            second = await trio.open_tcp_stream(host, port)
            assert await second.receive_some(10) == b"ok"
            await first.aclose()
            await second.aclose()
            nursery.cancel_scope.cancel()
    assert "event=wire_handler_failed" in caplog.text
