"""A proxy in front of a real ``redis-server`` that can be told to misbehave.

The shared-limits tests put it between an edge and the store to play a
store that answers garbage, a truncated reply or nothing at all, while the
real server behind it keeps the counters.  Modes (:attr:`RogueProxy.mode`),
applied to each reply the server sends while the mode is set:

* ``relay``: bytes pass both ways unchanged;
* ``garbage``: the reply is replaced by bytes that are no RESP at all;
* ``truncate``: the reply is replaced by the head of a bulk string that
  announces a gigabyte (``$1000000000\\r\\nabc``), and nothing more follows on
  that connection;
* ``stall``: the reply is held back (not sent) until the mode changes, then
  sent as the new mode says.

Every connection relays through two trio tasks; :attr:`connections` counts
those accepted, so a test can see a client rebuilt.
"""

from __future__ import annotations

from typing import Literal

import trio

__all__ = ["TRUNCATED", "Mode", "RogueProxy"]

Mode = Literal["relay", "garbage", "truncate", "stall"]
TRUNCATED = b"$1000000000\r\nabc"
GARBAGE = b"\x00\xffnot resp at all\r\n"


class RogueProxy:
    """Listens on a free loopback port and relays to ``127.0.0.1:upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode: Mode = "relay"
        self.port = 0
        self.connections = 0
        self.replies_spoiled = 0
        self._changed = trio.Event()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def set_mode(self, mode: Mode) -> None:
        self.mode = mode
        self._changed.set()
        self._changed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[RogueProxy] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
        except OSError:
            await client.aclose()
            return
        async with client, server, trio.open_nursery() as nursery:

            async def upward() -> None:
                with trio.move_on_after(3600):
                    async for data in client:
                        await server.send_all(data)
                nursery.cancel_scope.cancel()

            async def downward() -> None:
                async for data in server:
                    while self.mode == "stall":
                        await self._changed.wait()
                    if self.mode == "relay":
                        await client.send_all(data)
                        continue
                    self.replies_spoiled += 1
                    if self.mode == "garbage":
                        await client.send_all(GARBAGE)
                        continue
                    await client.send_all(TRUNCATED)  # and this connection says nothing more
                    await trio.sleep_forever()
                nursery.cancel_scope.cancel()

            nursery.start_soon(upward)
            nursery.start_soon(downward)
