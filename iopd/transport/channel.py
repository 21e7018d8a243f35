"""``WireChannel``: one trio stream + one sans-IO ``wire.Connection``.

Why it looks like this:

* One reader task (inside ``serve``) decodes frames and hands each message to a
  *synchronous* ``dispatch`` callback.  Dispatch never awaits, so a slow
  consumer can never stall the reader; whatever must be written in reaction
  (Pong, Credit, Cancel) is ``post``-ed to a small outbox drained by a writer
  task.
* One writer at a time, by group commit (see ``send``): frames are encoded in
  call order and written by whichever sender is the writer, in batches, first
  straight to the socket (``iopd.transport.fastsend``) and, for what the
  socket did not take, by a ``send_all`` shielded from cancellation: a
  cancelled caller must never leave half a frame on the wire.  A write that
  blocks forever (peer not reading) is ended by the heartbeat watchdog,
  which closes the stream under it.
* ``send_soon`` commits a frame like ``send`` but leaves its write to the
  end of the scheduler round (``iopd.transport.round_end``): what many
  tasks send in one round leaves in one write.  What the socket does not
  take then is finished by the outbox writer, and senders wait for it as
  they would for any writer.
* Heartbeats: every ``heartbeat_interval`` we send ``Heartbeat``; any traffic
  from the peer counts as life; nothing for ``heartbeat_timeout`` seconds means
  a dead peer and the channel closes.
* Every low-level failure (``trio.BrokenResourceError``,
  ``trio.ClosedResourceError``, ``OSError``, ``ssl.SSLError``, a
  ``RemoteProtocolError`` from the peer) is mapped to ``ChannelClosed`` in one
  place, ``_map_error``.  ``ChannelClosed`` subclasses
  ``trio.BrokenResourceError``, so code written against trio streams keeps
  working.
"""

from __future__ import annotations

import logging
import ssl
from collections import deque
from collections.abc import Callable
from typing import Literal

import trio

from iopd.transport.fastsend import receive_some, write_now
from iopd.transport.round_end import call_at_round_end
from wire.connection import Connection
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.messages import Heartbeat, Message, Pong

log = logging.getLogger("iopd.transport")

#: Bytes asked of the stream per read.
READ_SIZE = 65536
#: Messages the outbox may hold before the peer is considered stuck.
MAX_OUTBOX = 10_000
#: Bytes ``send_soon`` lets wait for the round's end; past them it writes at
#: once (and waits for the socket like ``send``).  The peer reads this much
#: at a time.
ROUND_BATCH_BYTES = READ_SIZE

CloseKind = Literal["eof", "broken", "protocol", "heartbeat", "local", "closed"]


class ChannelClosed(trio.BrokenResourceError):
    """The channel is gone.  ``reason`` is safe to log; ``kind`` says why.

    kinds: ``eof`` (peer closed cleanly), ``broken`` (I/O error), ``protocol``
    (the peer broke the protocol), ``heartbeat`` (peer silent too long),
    ``local`` (we broke the protocol: a bug), ``closed`` (we closed it).
    """

    def __init__(self, reason: str, kind: CloseKind = "broken") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind: CloseKind = kind


_MAPPED = (
    trio.ClosedResourceError,
    trio.BrokenResourceError,
    OSError,  # includes ssl.SSLError
    RemoteProtocolError,
    LocalProtocolError,
)


def _map_error(what: str, exc: BaseException) -> ChannelClosed:
    """The one boundary where low-level errors become ``ChannelClosed``.

    (A function used as ``except _MAPPED as exc: raise _map_error(...)`` rather
    than a context manager: it sits on the per-frame hot path.)
    """
    if isinstance(exc, ChannelClosed):
        return exc
    if isinstance(exc, trio.ClosedResourceError):
        return ChannelClosed(f"{what}: channel closed", "closed")
    if isinstance(exc, trio.BrokenResourceError):
        cause = exc.__cause__
        detail = f" ({type(cause).__name__})" if cause is not None else ""
        return ChannelClosed(f"{what}: connection broken{detail}", "broken")
    if isinstance(exc, ssl.SSLError):
        return ChannelClosed(f"{what}: TLS error ({exc.reason or type(exc).__name__})")
    if isinstance(exc, OSError):
        return ChannelClosed(f"{what}: {type(exc).__name__} errno={exc.errno}")
    if isinstance(exc, RemoteProtocolError):
        return ChannelClosed(f"protocol error: {exc.reason}", "protocol")
    if isinstance(exc, LocalProtocolError):
        return ChannelClosed(f"local protocol error: {exc.reason}", "local")
    raise TypeError(f"unmapped error {type(exc).__name__}")  # pragma: no cover


class WireChannel:
    """A wire connection over a trio stream: locked sends, a reader, heartbeats.

    Typical use: ``await send(...)`` / ``await receive_message()`` for the
    handshake, then ``await serve(dispatch, ...)`` for the session, which
    returns only by raising ``ChannelClosed``.  Always ``await aclose()`` (it
    is idempotent) in a ``finally``.
    """

    def __init__(self, stream: trio.abc.Stream, conn: Connection, *, name: str = "peer") -> None:
        self.stream = stream
        self.conn = conn
        self.name = name
        self._wbuf: list[bytes] = []  # frames encoded, not yet handed to the stream
        self._writing = False  # a task is inside the write loop
        self._flushed = trio.Event()  # set when the batch now being collected is written
        self._pending: deque[Message] = deque()  # decoded but not yet handed out
        self._outbox: deque[Message] = deque()
        self._outbox_wakeup = trio.Event()
        self._closed: ChannelClosed | None = None
        self._last_rx = trio.current_time()
        self._hb_seq = 0
        self._serve_scope: trio.CancelScope | None = None
        # ``send_soon``: only straight to a plain socket, and only while
        # ``serve`` runs (its outbox writer finishes what a round's write left).
        self._direct = type(stream) is trio.SocketStream
        self._round_end_due = False  # a round-end write is registered
        self._stalled = False  # the socket did not take a round's batch: wait as for a writer
        self._soon_bytes = 0  # committed by ``send_soon`` since the last write began
        self._token = trio.lowlevel.current_trio_token()

    @property
    def closed(self) -> bool:
        """True once the channel has been closed (by us or by a failure)."""
        return self._closed is not None

    @property
    def close_reason(self) -> str | None:
        return self._closed.reason if self._closed is not None else None

    # --------------------------------------------------------------- writing

    async def send(self, msg: Message) -> None:
        """Send one message; returns once its bytes are handed to the stream.

        Raises ``ChannelClosed`` when the channel is gone, and
        ``wire.errors.LocalProtocolError`` (nothing sent) when ``msg`` is not
        legal now: that is a bug of the caller, not a peer problem.

        One writer at a time, by group commit: the frame is checked and encoded
        at once (so frames go out in call order), appended to the write
        buffer, and either this task becomes the writer (writing every frame
        queued meanwhile in one ``send_all``) or it waits for the writer to
        flush the batch holding its frame.  Under load this coalesces many
        small frames into one syscall, and a cancelled waiter can never leave
        half a frame behind: its frame is already committed.
        """
        if self._closed is not None:
            raise self._closed
        self._wbuf.append(self.conn.send(msg))
        if self._writing:
            flushed = self._flushed
            await flushed.wait()
            if self._closed is not None:
                raise self._closed
            return
        await self._write_loop()

    async def send_soon(self, msg: Message) -> None:
        """Like ``send``, but the write may wait for the end of this scheduler round.

        Every frame committed by any task during one round of trio's run loop
        then leaves in one write, just before the loop polls for I/O, and the
        peer wakes once for all of them.  Nothing waits past the round, and
        nothing waits at all while its stream is the only one open (no other
        frame could join it).  While a write is waiting for the socket (a
        writer is busy, or a round's batch was not taken whole) this waits
        like ``send``, so a peer that does not read holds its senders back.
        The frame is committed when this returns or raises ``Cancelled``.
        """
        conn = self.conn
        if (
            self._writing
            or self._stalled
            or conn.open_stream_count < 2  # no other stream's frame could join it
            or self._serve_scope is None
            or not self._direct
        ):
            await self.send(msg)
            return
        if self._closed is not None:
            raise self._closed
        frame = conn.send(msg)
        self._wbuf.append(frame)
        self._soon_bytes += len(frame)
        if self._soon_bytes >= ROUND_BATCH_BYTES:
            await self.flush()  # enough for one write: no reason to wait
            return
        if not self._round_end_due:
            self._round_end_due = True
            call_at_round_end(self._write_at_round_end)
        await trio.lowlevel.checkpoint_if_cancelled()

    def _write_at_round_end(self) -> None:
        """The round's frames in one write (from the run loop: no task is woken here)."""
        self._round_end_due = False
        if self._writing or self._closed is not None or not self._wbuf:
            return  # a writer took them, or they went with the channel
        batch = self._take_batch()
        try:
            written = write_now(self.stream, batch)
        except _MAPPED:
            written = 0  # the outbox writer meets the error again and closes the channel
        if written == len(batch):
            self._stalled = False
            return
        # The rest stays first in line, so frames committed later go out after
        # it.  No task can be woken from here (see ``round_end``), so the
        # outbox writer is woken through the run loop and writes the rest;
        # until it has, ``_stalled`` makes ``send_soon`` wait like ``send``
        # and a peer that does not read holds its senders back.
        self._wbuf = [batch[written:]]
        self._stalled = True
        try:
            self._token.run_sync_soon(self._wake_writer)
        except trio.RunFinishedError:  # pragma: no cover - the run is ending
            pass

    def _wake_writer(self) -> None:
        self._outbox_wakeup.set()

    def _take_batch(self) -> bytes:
        """Everything committed and not yet written, as one piece; the buffer empties."""
        wbuf = self._wbuf
        self._wbuf = []
        self._soon_bytes = 0
        return wbuf[0] if len(wbuf) == 1 else b"".join(wbuf)

    def queue(self, msg: Message) -> None:
        """Commit ``msg`` like ``send`` but leave the write to the next ``send``/``flush``.

        For a sender that knows another frame follows at once (an HTTP head
        whose body is already read, the usage before a terminal): both leave
        in one write, and the peer wakes up once.  The caller must make sure
        a ``send`` or ``flush`` follows.
        """
        if self._closed is not None:
            raise self._closed
        self._wbuf.append(self.conn.send(msg))

    async def flush(self) -> None:
        """Write every frame ``queue`` left behind (returns at once if none)."""
        if self._closed is not None:
            raise self._closed
        if not self._wbuf:
            return
        if self._writing:
            await self._flushed.wait()
            if self._closed is not None:
                raise self._closed
            return
        await self._write_loop()

    async def _write_loop(self) -> None:
        # The group commit.  ``_flushed`` belongs to the batch being collected:
        # a sender that commits while a write is under way waits on it.
        # Taking a batch swaps in a fresh event, so frames committed during
        # this write wait for the next turn of the loop, which the writer
        # makes before it lets go: no committed frame is left without a
        # writer, and each waiter wakes once its own bytes are handed to the
        # stream.  The write is shielded because the writer's own cancel must
        # not cut a batch that holds other senders' frames; a peer that stops
        # reading is ended by the heartbeat watchdog closing the stream under
        # it.  When the channel closes, the waiters of the untaken batch are
        # woken and raise ``ChannelClosed``.
        self._writing = True
        try:
            while self._wbuf:
                batch = self._take_batch()
                done, self._flushed = self._flushed, trio.Event()
                try:
                    # Straight to the socket when it takes it all (the common
                    # case: no scheduler round, nothing to shield).
                    written = write_now(self.stream, batch)
                    if written < len(batch):
                        with trio.CancelScope(shield=True):
                            await self.stream.send_all(memoryview(batch)[written:])
                except _MAPPED as exc:
                    closed = _map_error("send", exc)
                    self._mark_closed(closed)
                    raise closed from None
                finally:
                    done.set()
        finally:
            self._writing = False
            if not self._wbuf:
                self._stalled = False
            if self._closed is not None:
                self._wbuf = []
                self._flushed.set()

    def post(self, msg: Message) -> None:
        """Queue ``msg`` for the writer task without waiting (from sync code).

        Messages that are no longer legal when their turn comes (a Credit or
        Cancel for a stream that ended meanwhile is still legal; anything else
        illegal) are dropped with a debug log.  No-op once closed.
        """
        if self._closed is not None:
            return
        if len(self._outbox) >= MAX_OUTBOX:
            self._fail(ChannelClosed("outbox overflow: peer is not reading", "heartbeat"))
            return
        self._outbox.append(msg)
        self._outbox_wakeup.set()

    async def _drain_outbox(self) -> None:
        while True:
            await self._outbox_wakeup.wait()
            self._outbox_wakeup = trio.Event()
            # (Also after a round-end write the socket took in part: then the
            # rest waits in ``_wbuf`` for a writer.)
            while self._outbox or self._wbuf:
                # Commit everything queued, then write it in one go: one flush
                # per message let Credits posted by the reader pile up faster
                # than they drained (and a Cancel waited behind them).
                try:
                    while self._outbox:
                        msg = self._outbox.popleft()
                        try:
                            self.queue(msg)
                        except LocalProtocolError as exc:
                            log.debug("dropped queued %s: %s", type(msg).__name__, exc.reason)
                    await self.flush()
                except ChannelClosed as exc:
                    self._fail(exc)
                    return

    # --------------------------------------------------------------- reading

    async def _read_more(self) -> list[Message]:
        """Read once from the stream; return decoded messages (maybe none).

        Raises ``ChannelClosed`` at EOF, on I/O errors and protocol errors.
        """
        if self._closed is not None:
            raise self._closed
        try:
            data = await receive_some(self.stream, READ_SIZE)
            if not data:
                self.conn.receive_eof()
                raise ChannelClosed("peer closed the connection", "eof")
            msgs = self.conn.receive_data(data)
        except _MAPPED as exc:
            closed = _map_error("receive", exc)
            self._mark_closed(closed)
            raise closed from None
        self._last_rx = trio.current_time()
        return msgs

    async def receive_message(self) -> Message:
        """Return the next message (for the handshake, before ``serve``)."""
        while not self._pending:
            self._pending.extend(await self._read_more())
        return self._pending.popleft()

    # --------------------------------------------------------------- session

    async def serve(
        self,
        dispatch: Callable[[Message], None],
        *,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        end_of_batch: Callable[[], None] | None = None,
    ) -> None:
        """Run the session: reader, outbox writer, heartbeats.  Never returns normally.

        ``dispatch`` is called for every message except Heartbeat/Pong (handled
        here), in order, from the reader task; it must not block.  It may
        raise ``RemoteProtocolError`` to reject a message.  ``end_of_batch``
        (never blocking either) is called once the messages of one read have
        been dispatched, so a consumer can write what they brought in one go.
        Ends by raising ``ChannelClosed`` (the stream is closed by then).
        """
        self._last_rx = trio.current_time()
        try:
            # Children never raise ChannelClosed (that would arrive wrapped in an
            # ExceptionGroup): they call ``_fail``, which records the reason and
            # cancels this nursery.
            async with trio.open_nursery() as nursery:
                self._serve_scope = nursery.cancel_scope
                if self._closed is not None:
                    nursery.cancel_scope.cancel()
                nursery.start_soon(self._drain_outbox)
                nursery.start_soon(self._heartbeat, heartbeat_interval)
                nursery.start_soon(self._watchdog, heartbeat_timeout)
                try:
                    while self._pending:
                        self._dispatch_one(dispatch, self._pending.popleft())
                    while True:
                        msgs = await self._read_more()
                        try:
                            for msg in msgs:
                                self._dispatch_one(dispatch, msg)
                        finally:
                            if end_of_batch is not None:
                                end_of_batch()
                except ChannelClosed as exc:
                    self._fail(exc)
        finally:
            await self.aclose()
        assert self._closed is not None
        raise self._closed

    def _dispatch_one(self, dispatch: Callable[[Message], None], msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            self.post(Pong(seq=msg.seq))
        elif not isinstance(msg, Pong):
            try:
                dispatch(msg)
            except RemoteProtocolError as exc:
                self.conn.close()
                raise ChannelClosed(f"protocol error: {exc.reason}", "protocol") from None

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            self._hb_seq += 1
            self.post(Heartbeat(seq=self._hb_seq))

    async def _watchdog(self, timeout: float) -> None:
        while True:
            deadline = self._last_rx + timeout
            if trio.current_time() >= deadline:
                self._fail(
                    ChannelClosed(f"peer silent for {timeout:g}s (heartbeat timeout)", "heartbeat")
                )
                return
            await trio.sleep_until(deadline)

    # --------------------------------------------------------------- closing

    def _mark_closed(self, exc: ChannelClosed) -> None:
        if self._closed is None:
            self._closed = exc
            self.conn.close()

    def _fail(self, exc: ChannelClosed) -> None:
        """Sync close from anywhere: records the reason and ends ``serve``."""
        self._mark_closed(exc)
        if self._serve_scope is not None:
            self._serve_scope.cancel()

    def close_soon(self, reason: str) -> None:
        """Close from sync code: ``serve`` ends with ``ChannelClosed(reason, "closed")``."""
        self._fail(ChannelClosed(reason, "closed"))

    async def aclose(self, reason: str = "closed") -> None:
        """Close the stream (idempotent, never blocks on the peer)."""
        self._mark_closed(ChannelClosed(reason, "closed"))
        await trio.aclose_forcefully(self.stream)
