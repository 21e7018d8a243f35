"""``NodeLink``: the node's session with one edge — dial out, handshake, serve, reconnect.

Why it looks like this:

* One ``NodeLink`` per edge (``iopd.node.edges.sessions.EdgeSessions`` owns them):
  each has its own backoff, heartbeats and session nursery, so losing one
  edge stops only that edge's streams.
* ``run()`` loops forever: dial the edge, run the handshake
  (``iopd.node.edges.handshake``: SCRAM, the token never crosses), serve the
  session, and after any loss back off (exponential, full jitter,
  ``reconnect_initial_backoff`` .. ``reconnect_max_backoff``; reset after a
  session got through the handshake) and dial again.  A refusal for
  ``bad_token``/``unknown_node``/``version_mismatch``, or an edge that cannot
  prove it holds the node's verifier, cannot be fixed by retrying fast, so
  those retry near the cap, loudly.
* A session has one nursery: the channel's reader dispatches synchronously;
  each ``RunRequest``/``ProviderTunnelRequest`` gets ``handler.start_early``
  from the reader (early start: a passthrough request may leave for the
  provider right there) and runs ``handler.serve_stream(req, sender, early)``
  in its own task; config pushes are
  applied one at a time, in order, by a single task; each ack is followed by
  the node's config state (``NodeConfigState``), and the session's first ack
  is preceded by its control state (``ControlState``).  Losing the link cancels
  the nursery, so every run of that session stops.
* ``LinkSender.send`` enforces the credit window: it waits while the
  stream has no credit left (the terminal message never waits).
* Admission (``iopd.node.edges.admission``, given as ``admission``): the reader
  admits every run and tunnel against the node's slots before spawning it,
  or answers ``Busy`` at once.  The slot goes back just before the stream's
  terminal is sent (so the edge, which frees its lease on reading it, never
  opens its next stream before the node freed the slot), or when the stream's
  task ends without one (cancelled with the link).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import msgspec
import trio

from iopd.config.schema import NodeSection
from iopd.http.client import EarlyStart
from iopd.node.edges.admission import AdmissionView, Slot
from iopd.node.edges.handshake import HandshakeFailed, SaltedPasswords, client_handshake
from iopd.node.handler import NodeHandler
from iopd.node.stream_out import LinkSender
from iopd.transport.channel import ChannelClosed, WireChannel
from iopd.transport.dial import Backoff, DialError, dial
from iopd.transport.tls import client_ssl_context
from wire.connection import Connection, Role, StreamState
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.framing import HTTP_SERVER_REASON
from wire.messages import (
    Busy,
    Cancel,
    ControlUpdate,
    Credit,
    GoAway,
    HelloAck,
    LoadReport,
    Message,
    NodeConfig,
    NodeConfigAck,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    Refused,
    RunEvent,
    RunRequest,
    SlotLoad,
    Waiting,
)

log = logging.getLogger("iopd.node.link")  # (its name before the package moved)

#: Config pushes that may wait for the config task before the edge is misbehaving.
MAX_PENDING_CONFIGS = 8
#: Refusals that retrying fast cannot fix: the node retries near the backoff cap.
_SLOW_REFUSALS = frozenset({"bad_token", "unknown_node", "version_mismatch"})
_REFUSAL_HINTS = {
    "bad_token": "check node.token against this edge's nodes[] verifier or hash",
    "unknown_node": "check node.id against this edge's nodes[]",
    "version_mismatch": "run the same iopd release on edges and nodes",
}


def parse_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


class NodeLink:
    """The node's connection to one edge; implements ``iopd.node.handler.StatusSink``.

    Test hooks: ``connected`` (bool), ``await wait_connected()``,
    ``await wait_disconnected()``, ``sessions`` (handshakes completed),
    ``last_refused`` and ``last_error``.
    """

    def __init__(
        self,
        cfg: NodeSection,
        handler: NodeHandler,
        *,
        software_version: str,
        edge: str | None = None,
        key: str | None = None,
        salted: SaltedPasswords | None = None,
        admission: AdmissionView | None = None,
        connect_timeout: float = 10.0,
        handshake_timeout: float = 10.0,
        rng: Callable[[], float] = random.random,
    ) -> None:
        """``edge``: the address to dial (default: ``cfg.edge``, else the first of
        ``cfg.edges``); ``salted``: derived keys shared by the node's links;
        ``admission``: the node's slots as this edge's streams take them (None:
        nothing is counted, every stream is admitted)."""
        self.cfg = cfg
        self.handler = handler
        self.software_version = software_version
        self.connect_timeout = connect_timeout
        self.handshake_timeout = handshake_timeout
        self.edge = edge or cfg.edge or cfg.edges[0]
        #: What this link's streams and slots are kept under: the address, or for
        #: the successor of a link told ``GoAway``, the address and a generation.
        self.key = key or self.edge
        self.host, self.port = parse_host_port(self.edge)
        #: Told ``GoAway``: serve what is in flight, then end without reconnecting.
        self.retiring = False
        #: Called once when the edge says ``GoAway`` (``EdgeSessions`` dials again).
        self.on_go_away: Callable[[NodeLink], None] | None = None
        self._salted = salted if salted is not None else SaltedPasswords()
        self.admission = admission
        self._ssl_context = client_ssl_context(cfg.tls)
        self.backoff = Backoff(cfg.reconnect_initial_backoff, cfg.reconnect_max_backoff, rng=rng)
        self._channel: WireChannel | None = None
        self._senders: dict[int, LinkSender] = {}
        self._nursery: trio.Nursery | None = None
        self._configs: trio.MemorySendChannel[NodeConfig] | None = None
        self.connected = False
        self._connected_event = trio.Event()
        self._disconnected_event = trio.Event()
        self._disconnected_event.set()
        self.sessions = 0
        self.last_refused: Refused | None = None
        self.last_error: str | None = None
        self._stopping = False

    # ---------------------------------------------------------------- public

    async def wait_connected(self) -> None:
        """Wait until a session is established (returns at once if it is)."""
        await self._connected_event.wait()

    async def wait_disconnected(self) -> None:
        """Wait until no session is established (returns at once if none is)."""
        await self._disconnected_event.wait()

    async def shutdown(self, timeout: float = 2.0) -> None:
        """End the session cleanly, for a node that is stopping (its streams are done).

        Writes what is queued, sends EOF and lets the reader run until the
        edge closes its side (at most ``timeout`` seconds), so the socket is
        closed with nothing unread: a close with unread bytes makes the
        kernel reset the connection, and a reset can destroy the last frames
        still on their way to the edge.  No reconnect follows.  Over TLS the
        stream cannot half-close; closing it sends the TLS close_notify.
        """
        self._stopping = True
        channel = self._channel
        if channel is None or not self.connected or channel.closed:
            return
        with trio.move_on_after(timeout):
            try:
                await channel.flush()
                stream = channel.stream
                if isinstance(stream, trio.abc.HalfCloseableStream):
                    await stream.send_eof()
            except (ChannelClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                return
            await self.wait_disconnected()

    def send_status(self, msg: ProviderStatus | LoadReport) -> None:
        """Queue a provider status or load report for the edge; a no-op while
        disconnected."""
        self.post(msg)

    def post(self, msg: Message) -> None:
        """Queue a session message (status, load, config or control state) for the
        edge; a no-op while disconnected."""
        channel = self._channel
        if self.connected and channel is not None and not channel.closed:
            channel.post(msg)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect and serve forever, reconnecting with backoff; ends only when cancelled.

        ``task_status.started()`` is reported at once (not after the first
        handshake): a node with its edge down still starts.
        """
        task_status.started()
        while True:
            delay = await self._attempt()
            if self.retiring:  # its successor serves this edge now
                log.info("event=edge_link_retired edge=%s", self.edge)
                return
            if self._stopping:
                await trio.sleep_forever()  # shut down: no reconnect; the caller cancels
            log.info("event=edge_reconnect edge=%s:%d delay_s=%.2f", self.host, self.port, delay)
            await trio.sleep(delay)

    # ---------------------------------------------------------------- one attempt

    async def _attempt(self) -> float:
        """Dial, handshake, serve until lost.  Returns the delay before the next try."""
        try:
            stream = await dial(
                self.host,
                self.port,
                ssl_context=self._ssl_context,
                server_hostname=self.cfg.tls.server_hostname,
                connect_timeout=self.connect_timeout,
            )
        except DialError as exc:
            self.last_error = exc.reason
            delay = self.backoff.next()
            msg = "event=edge_unreachable edge=%s reason=%r retry_in_s=%.2f"
            log.warning(msg, self.edge, exc.reason, delay)
            return delay
        channel = WireChannel(
            stream,
            Connection(Role.NODE, max_frame_bytes=self.cfg.max_frame_bytes),
            name=f"{self.host}:{self.port}",
        )
        try:
            return await self._session(channel)
        except ChannelClosed as exc:
            self.last_error = exc.reason
            if not self._stopping and HTTP_SERVER_REASON in exc.reason:
                return self._http_server()
            if self._stopping:
                log.info("event=edge_link_closed edge=%s reason=%r", self.edge, exc.reason)
            elif exc.kind == "protocol":
                log.error(
                    "event=edge_link_lost edge=%s kind=protocol reason=%r", self.edge, exc.reason
                )
            else:
                log.warning(
                    "event=edge_link_lost edge=%s kind=%s reason=%r",
                    self.edge,
                    exc.kind,
                    exc.reason,
                )
            return self.backoff.next()
        finally:
            with trio.CancelScope(shield=True):
                await channel.aclose()
            self._set_disconnected()

    async def _session(self, channel: WireChannel) -> float:
        try:
            ack = await client_handshake(
                channel,
                node_id=self.cfg.id,
                token=self.cfg.token,
                software_version=self.software_version,
                timeout=self.handshake_timeout,
                salted=self._salted,
                accept_legacy_proof=self.cfg.accept_legacy_proof,
            )
        except HandshakeFailed as exc:
            return self._handshake_failed(exc)
        self.backoff.reset()
        await self._serve(channel, ack)
        raise AssertionError("unreachable")  # _serve only ends by raising

    def _http_server(self) -> float:
        """The edge address answered in HTTP (the OpenAI port?): say which key to fix;
        retried slowly (a retry cannot fix it)."""
        key = "node.edges" if self.cfg.edges else "node.edge"
        self.last_error = (
            f"{self.host}:{self.port} answered in HTTP: this is an HTTP server, not an iopd "
            f"wire listener: point {key} at edge.node_listen"
        )
        delay = self.backoff.max_delay()
        log.error(
            "event=edge_link_lost edge=%s kind=protocol reason=%r retry_in_s=%.2f",
            self.edge,
            self.last_error,
            delay,
        )
        return delay

    def _handshake_failed(self, exc: HandshakeFailed) -> float:
        """Log why the handshake failed (one line, never the token); the delay to wait."""
        refused = exc.refused
        if refused is None and HTTP_SERVER_REASON in exc.reason:
            return self._http_server()
        if refused is None:
            self.last_error = exc.reason
            log.log(
                logging.ERROR if exc.slow else logging.WARNING,
                "event=%s node=%s edge=%s:%d reason=%r",
                exc.event,
                self.cfg.id,
                self.host,
                self.port,
                exc.reason,
            )
            return self.backoff.max_delay() if exc.slow else self.backoff.next()
        self.last_refused = refused
        self.last_error = f"refused: {refused.code}: {refused.reason}"
        if refused.code in _SLOW_REFUSALS:
            log.error(
                "event=node_refused_by_edge node=%s edge=%s:%d code=%s reason=%r hint=%r",
                self.cfg.id,
                self.host,
                self.port,
                refused.code,
                refused.reason,
                _REFUSAL_HINTS[refused.code] + "; retrying slowly",
            )
            return self.backoff.max_delay()
        log.warning(
            "event=node_refused_by_edge node=%s edge=%s:%d code=%s reason=%r",
            self.cfg.id,
            self.host,
            self.port,
            refused.code,
            refused.reason,
        )
        return self.backoff.next()

    async def _serve(self, channel: WireChannel, ack: HelloAck) -> None:
        config_send, config_recv = trio.open_memory_channel[NodeConfig](MAX_PENDING_CONFIGS)
        closed: ChannelClosed | None = None
        async with trio.open_nursery() as nursery:
            self._channel = channel
            self._nursery = nursery
            self._configs = config_send
            self._senders = {}
            self._set_connected(ack)
            if self.admission is not None:
                self.admission.connected()
            nursery.start_soon(self._apply_configs, channel, config_recv)
            try:
                await channel.serve(
                    self._dispatch,
                    heartbeat_interval=ack.heartbeat_interval,
                    heartbeat_timeout=ack.heartbeat_timeout,
                )
            except ChannelClosed as exc:
                closed = exc
            finally:
                self._set_disconnected()
                if self.admission is not None:
                    self.admission.disconnected()
                nursery.cancel_scope.cancel()
        raise closed or ChannelClosed("session ended", "closed")

    # ---------------------------------------------------------------- session tasks

    def _dispatch(self, msg: Message) -> None:
        """Called by the reader for every edge message; never blocks."""
        channel, nursery = self._channel, self._nursery
        assert channel is not None and nursery is not None
        if isinstance(msg, RunRequest | ProviderTunnelRequest):
            release: Callable[[], None] | None = None
            admission = self.admission
            if admission is not None:
                verdict = admission.admit(msg.provider_id, msg.long_context)
                if isinstance(verdict, SlotLoad):  # full: the edge routes it elsewhere
                    channel.post(Busy(stream_id=msg.stream_id, load=verdict))
                    return
                if verdict is not None:
                    release = _releaser(admission, verdict)
            sender = LinkSender(channel, msg.stream_id, release)
            self._senders[msg.stream_id] = sender
            early = self.handler.start_early(msg)  # may write it to the provider now
            try:
                nursery.start_soon(self._serve_stream, channel, msg, sender, early)
            except BaseException:
                sender.release_slot()
                if early is not None:
                    early.abandon()
                raise
        elif isinstance(msg, Credit):
            waiting = self._senders.get(msg.stream_id)
            if waiting is not None:
                waiting.credit_arrived()
        elif isinstance(msg, Cancel):
            if msg.stream_id in self._senders:
                try:
                    self.handler.cancel(msg.stream_id, msg.reason)
                except Exception:
                    log.exception("event=cancel_failed stream=%d", msg.stream_id)
        elif isinstance(msg, Waiting):
            if self.admission is not None:
                self.admission.set_waiting(msg.provider_id, msg.waiting)
        elif isinstance(msg, ControlUpdate):
            try:
                self.handler.on_controls(msg)
            except Exception:
                log.exception("event=control_update_failed edge=%s", self.edge)
        elif isinstance(msg, GoAway):
            if not self.retiring:
                self.retiring = True
                log.info("event=edge_go_away edge=%s reason=%r", self.edge, msg.reason[:200])
                if self.on_go_away is not None:
                    self.on_go_away(self)
        elif isinstance(msg, NodeConfig):
            assert self._configs is not None
            try:
                self._configs.send_nowait(msg)
            except trio.WouldBlock:
                raise RemoteProtocolError(
                    f"more than {MAX_PENDING_CONFIGS} config pushes pending"
                ) from None

    async def _serve_stream(
        self,
        channel: WireChannel,
        req: RunRequest | ProviderTunnelRequest,
        sender: LinkSender,
        early: EarlyStart | None,
    ) -> None:
        stream_id = req.stream_id
        try:
            await self.handler.serve_stream(req, sender, early)  # which owns ``early`` now
        except (ChannelClosed, trio.ClosedResourceError):
            pass
        except Exception:
            log.exception("event=serve_stream_failed stream=%d", stream_id)
        finally:
            sender.release_slot()
            self._senders.pop(stream_id, None)
        if channel.conn.stream_state(stream_id) in (StreamState.OPEN, StreamState.CANCELLED):
            # The executor ended without a terminal: close the stream for it.
            terminal: RunEvent | ProviderTunnelFrame
            if isinstance(req, RunRequest):
                terminal = RunEvent(
                    stream_id=stream_id,
                    kind="error",
                    code="provider_error",
                    message="node ended the run without a result",
                )
            else:
                terminal = ProviderTunnelFrame(
                    stream_id=stream_id,
                    kind="error",
                    code="provider_error",
                    message="node ended the tunnel without a result",
                )
            try:
                await channel.send(terminal)
            except (ChannelClosed, LocalProtocolError):
                pass

    async def _apply_configs(
        self, channel: WireChannel, configs: trio.MemoryReceiveChannel[NodeConfig]
    ) -> None:
        first = True
        async for cfg in configs:
            try:
                ack = await self.handler.on_config(cfg)
                ack = msgspec.structs.replace(ack, stream_id=cfg.stream_id)
                if self.admission is not None:
                    self.admission.reconfigured()  # a capacity may have grown
            except Exception as exc:
                log.exception("event=node_config_failed version=%d", cfg.version)
                ack = NodeConfigAck(
                    stream_id=cfg.stream_id,
                    version=cfg.version,
                    ok=False,
                    error=f"{type(exc).__name__}: {str(exc)[:200]}",
                )
            try:
                if first:
                    # Before the ack that makes the session routable on the
                    # edge: a provider drained from another edge is never
                    # offered a request here in between.
                    channel.queue(self.handler.control_state())
                await channel.send(ack)
                await channel.send(self.handler.config_state())
                if first:
                    first = False
                    await channel.send(self.handler.current_status())
            except ChannelClosed:
                return
            log.info("event=node_config_ack version=%d ok=%s", cfg.version, ack.ok)

    # ---------------------------------------------------------------- state

    def _set_connected(self, ack: HelloAck) -> None:
        self.sessions += 1
        self.connected = True
        self.last_error = None
        self.last_refused = None
        self._disconnected_event = trio.Event()
        self._connected_event.set()
        log.info(
            "event=edge_connected edge_id=%s edge=%s:%d heartbeat_s=%g heartbeat_timeout_s=%g",
            ack.edge_id,
            self.host,
            self.port,
            ack.heartbeat_interval,
            ack.heartbeat_timeout,
        )

    def _set_disconnected(self) -> None:
        if self.connected:
            self.connected = False
            self._connected_event = trio.Event()
            self._disconnected_event.set()
        self._channel = None
        self._nursery = None
        self._configs = None


def _releaser(admission: AdmissionView, slot: Slot) -> Callable[[], None]:
    """The callable that gives ``slot`` back (bound once per admitted stream)."""
    return lambda: admission.release(slot)
