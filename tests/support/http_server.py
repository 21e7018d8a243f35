"""A served iopd HTTP listener for tests of the server and of what writes through it: running, connect, get."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import h11
import trio
import trio.testing

from iopd.edge.openai.outgoing.error_envelope import render_error
from iopd.http.server import (
    HttpLimits,
    HttpServer,
    Request,
    Responder,
)

LIMITS = HttpLimits(
    max_body_bytes=1024,
    max_header_bytes=2048,
    header_timeout=5.0,
    body_timeout=5.0,
    idle_timeout=20.0,
)


HandlerFn = Callable[[Request, Responder], Awaitable[None]]


async def echo_handler(request: Request, responder: Responder) -> None:
    body = json.dumps(
        {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "body": request.body.decode(),
            "client_port": request.client[1] if request.client else None,
            "host": request.header("HOST"),
        }
    ).encode()
    await responder.send(200, [("content-type", "application/json")], body)


class Client:
    """A raw TCP client with an h11 parser for the responses."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = h11.Connection(h11.CLIENT)
        # We write raw bytes ourselves; tell the parser what we "sent".
        self.parser_primed = False

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def response(self, method: bytes = b"GET") -> tuple[int, dict[str, str], bytes]:
        """Read one response (the parser tracks request/response pairing)."""
        p = self.parser
        if p.our_state is h11.DONE and p.their_state is h11.DONE:
            p.start_next_cycle()
        if p.our_state is h11.IDLE:
            p.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
            p.send(h11.EndOfMessage())
        status = 0
        headers: dict[str, str] = {}
        body = b""
        while True:
            event = p.next_event()
            if event is h11.NEED_DATA:
                p.receive_data(await self.stream.receive_some(65536))
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, headers, body
            else:
                raise AssertionError(f"unexpected {event!r}")

    async def read_to_eof(self) -> bytes:
        """Every byte the server sends until it closes the connection."""
        data = b""
        while chunk := await self.stream.receive_some(65536):
            data += chunk
        return data

    async def at_eof(self) -> bool:
        """True when the server closed the connection (EOF or reset)."""
        try:
            while True:
                data = await self.stream.receive_some(65536)
                if not data:
                    return True
        except trio.BrokenResourceError:
            return True


@asynccontextmanager
async def running(
    handler: HandlerFn = echo_handler,
    limits: HttpLimits = LIMITS,
    **kwargs: object,
) -> AsyncIterator[tuple[int, HttpServer]]:
    server = HttpServer(handler, limits=limits, render_error=render_error, **kwargs)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield port, server
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[Client]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        yield Client(stream)
    finally:
        await trio.aclose_forcefully(stream)


def get(path: str = "/", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()
