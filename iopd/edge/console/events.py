"""``GET /events``: the console's document as server-sent events, pushed on change.

Why a poll and not a callback from every place that changes something: in
flight counts, health, node sessions, usage and errors change in a dozen
places of the edge, and an operator's screen needs at most a few frames a
second.  So each stream looks at the document every ``tick`` seconds and
sends it only when its bytes differ from the last sent (changes within a
tick are coalesced into one event); a comment every ``heartbeat`` seconds
keeps proxies and the browser's idea of the connection alive.

Bounded: at most ``StreamSlots.limit`` streams hold a slot at once (a new one
displaces the oldest, see ``StreamSlots``), one document held per stream, each write waits
for the client to take the previous one (the server's backpressure; the
admin listener gives an event stream's write ``AdminLimits.stream_send_timeout``,
so a client that stopped reading ends its stream and frees the slot), and a
stream ends after ``max_age`` seconds (the browser's EventSource reconnects
by itself), when the client goes away (quart-trio cancels the handler) or
when the edge drains (``EdgeRuntime.stopping``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import msgspec
import trio

from iopd.edge.console.view import console_view
from iopd.edge.runtime.edge_runtime import EdgeRuntime

__all__ = ["MAX_STREAMS", "StreamSlots", "StreamTicket", "StreamTiming", "status_events"]

#: Event streams open at once per admin listener.
MAX_STREAMS: Final = 8
#: How long the browser waits before it reconnects (ms), sent as ``retry:``.
RECONNECT_MS: Final = 2000
#: The ``retry:`` hint sent to a stream refused for want of a slot (ms).
BUSY_RETRY_MS: Final = 10000

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True)
class StreamTiming:
    """Seconds: how often a stream looks for a change, the heartbeat, its longest life."""

    tick: float = 0.5
    heartbeat: float = 15.0
    max_age: float = 1800.0


class StreamSlots:
    """Open event streams with a ceiling; when every slot is held, a new stream
    displaces the oldest.

    Why displace instead of refusing the newcomer: a tab that stopped reading
    while the document does not change gets only a heartbeat now and then, so
    its writes never fill the socket buffers, the send deadline never ends it,
    and refused newcomers would wait out its ``max_age``.  The displaced stream
    sees its ticket's ``displaced`` at its next tick (or when its write in
    progress returns, bounded by the admin listener's stream send deadline),
    sends a long ``retry`` hint and ends.  Streams still ending are bounded
    too: at most ``limit`` of them, so at most ``2 * limit`` streams are alive;
    past that a newcomer gets the ``retry`` hint at once.
    """

    def __init__(self, limit: int = MAX_STREAMS) -> None:
        self.limit = limit
        #: The tickets holding a slot, oldest first (dicts keep insertion order).
        self._held: dict[int, StreamTicket] = {}
        self._ending = 0
        self._issued = 0

    @property
    def open(self) -> int:
        """Streams alive: those holding a slot and those displaced but not yet ended."""
        return len(self._held) + self._ending

    def take(self) -> StreamTicket | None:
        """A ticket for a new stream (displacing the oldest when full), or None."""
        if len(self._held) >= self.limit:
            if self._ending >= self.limit:
                return None
            oldest = next(iter(self._held))
            self._held.pop(oldest).displaced.set()
            self._ending += 1
        self._issued += 1
        ticket = StreamTicket(self._issued)
        self._held[ticket.number] = ticket
        return ticket

    def give_back(self, ticket: StreamTicket) -> None:
        if self._held.pop(ticket.number, None) is None:
            self._ending -= 1  # it had been displaced


class StreamTicket:
    """One stream's hold on a slot; ``displaced`` is set when a newer stream takes it."""

    __slots__ = ("displaced", "number")

    def __init__(self, number: int) -> None:
        self.number = number
        self.displaced = trio.Event()


def status_event(payload: bytes) -> bytes:
    """One SSE ``status`` event (JSON has no raw newline, so one ``data:`` line)."""
    return b"event: status\ndata: " + payload + b"\n\n"


async def status_events(
    rt: EdgeRuntime, slots: StreamSlots, timing: StreamTiming = StreamTiming()
) -> AsyncIterator[bytes]:
    """The event stream of one console client (see the module doc).

    The slot is taken on the first iteration, inside the ``try`` that gives
    it back: a response that never starts sending holds no slot.
    """
    ticket = slots.take()
    if ticket is None:
        yield f": too many console streams\nretry: {BUSY_RETRY_MS}\n\n".encode()
        return
    try:
        yield f"retry: {RECONNECT_MS}\n\n".encode()
        last = b""
        last_write = started = trio.current_time()
        while not rt.stopping.is_set():
            if ticket.displaced.is_set():
                yield f": displaced by a newer console stream\nretry: {BUSY_RETRY_MS}\n\n".encode()
                break
            now = trio.current_time()
            if now - started >= timing.max_age:
                break
            payload = _encode(console_view(rt))
            if payload != last:
                last = payload
                yield status_event(payload)
                last_write = trio.current_time()
            elif now - last_write >= timing.heartbeat:
                yield b": heartbeat\n\n"
                last_write = trio.current_time()
            with trio.move_on_after(timing.tick):
                await rt.stopping.wait()
    finally:
        slots.give_back(ticket)
