"""The node keeps as many idle provider connections as the edge may use at once.

With a smaller idle pool, a provider busy at full capacity had half of its
connections closed and re-dialled on every request (bench_gateway c16).  An idle
connection the provider resets just as it is reused is retried on a fresh one.
"""

from __future__ import annotations

import functools
import socket
import struct

import trio

from iopd.http.client import ProviderHTTPClient
from iopd.node.adapters.openai import OpenAIAdapter
from tests.support.streams import read_head
from wire.messages import ProviderSpec


def test_idle_pool_covers_capacity_plus_the_probe() -> None:
    big = OpenAIAdapter(ProviderSpec(id="p", type="openai", base_url="http://x:1", capacity=32))
    assert big.client.max_idle_connections == 33
    small = OpenAIAdapter(ProviderSpec(id="q", type="openai", base_url="http://x:1", capacity=1))
    assert small.client.max_idle_connections == 8


async def test_reused_connection_reset_before_any_response_is_retried() -> None:
    # The keep-alive race: the provider closes an idle connection just as the
    # client reuses it, and the kernel answers the request with a RST.  A
    # clean EOF in that spot was retried on a fresh connection, a reset was
    # not: the run failed with "connection lost" (a 502 to the caller).
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    connections = 0

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        first_connection = connections == 1
        try:
            await read_head(stream)
            await stream.send_all(ok)
            if first_connection:
                await read_head(stream)  # the reused request: answer with a reset
                stream.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                stream.socket.close()
                return
            await read_head(stream)
        finally:
            await trio.aclose_forcefully(stream)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            client = ProviderHTTPClient(
                f"http://127.0.0.1:{port}", connect_timeout=5, read_timeout=5
            )
            assert (await client.request("POST", "/v1/chat/completions", body=b"{}")).status == 200
            assert client.idle_connections == 1
            resp = await client.request("POST", "/v1/chat/completions", body=b"{}")
            assert resp.status == 200
            assert client.connections_opened == 2
            await client.aclose()
            nursery.cancel_scope.cancel()
