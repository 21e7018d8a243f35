"""``NodeHub``: the edge's side of the wire — one ``NodeSession`` per connected node.

Why it looks like this:

* ``handle_connection`` is the ``serve_wire`` handler: handshake (Hello checked
  against the owner's node registry, then the SCRAM challenge of
  ``iopd.edge.nodes.challenge``; ``Refused`` otherwise, all within
  ``handshake_timeout``), then the session.  Every failure of one connection
  is caught and logged here; the hub keeps serving the others.
* The hub talks to the edge that runs it through one interface, ``HubOwner``:
  two queries (the node registry, a node's config) and the events
  ``node_connected``, ``node_disconnected``, ``provider_status``,
  ``node_config_state``, ``node_controls``, ``wire_frames`` and ``wire_error``.  The edge's runtime implements it.
* A session is "ready" (returned by ``session()``, announced with
  ``node_connected``) only after the node acknowledged its first
  ``NodeConfig``.  A node that rejects it (its adapters could not be built)
  is never announced: the edge logs why and closes the connection.
* A new connection for a node id that still has a session *replaces* it, once
  it has authenticated (a failing handshake leaves the old one alone): the old
  session's streams fail at once with ``NodeDispatchError`` and
  ``node_disconnected`` is told for it before the new one's ``node_connected``.
* Ending a session is one method, ``_end_session``, and its order is the
  contract with the owner: ``node_disconnected`` first (the pool stops
  admitting to the node), then the session's streams fail and free their
  leases, whose release re-examines the queue.
* ``retire``: a node that left the config is out of routing at once
  (``node_disconnected``); its session takes no new stream and ends once the
  open ones are done, which finish normally.
* Admission: a node's ``LoadReport`` goes to ``provider_load``;
  its ``Busy`` to ``provider_busy`` and then ends its stream with the error
  code ``node_busy``, which the request path answers by leasing again.
* Metering: ``wire_frames(direction, n)`` for every frame the edge's wire
  ``Connection`` encodes (``out``) or decodes (``in``), and ``wire_error``
  once per connection closed for a wire problem, with ``reason`` one of
  ``frame_too_large``, ``malformed``, ``protocol``, ``handshake`` (timeout or
  refusal) and ``heartbeat_timeout``; and ``pending_limit`` once per
  connection a listener's ``PendingGate`` (``listener_gate``) refused.  Frames are counted by a
  ``Connection`` subclass, so the transport needs no hook.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from iopd.edge.nodes.challenge import NodeVerifiers, Refusal, RefuseCode, challenge_node
from iopd.edge.nodes.hub_contract import HubOwner, HubSettings
from iopd.edge.nodes.metered import MeteredConnection, end_of_batch, wire_error_reason
from iopd.edge.nodes.node_session import NodeSession
from iopd.edge.nodes.node_text import needs_bounding, safe_node_reason, scrubbed_message
from iopd.errors import NodeDispatchError
from iopd.transport.channel import ChannelClosed, WireChannel
from iopd.transport.listen import PendingGate, RefusalReason
from iopd.vocabulary import FrameDirection, WireErrorReason
from wire.connection import Role
from wire.messages import (
    FEATURE_GO_AWAY,
    PROTOCOL_VERSION,
    Busy,
    ControlState,
    GoAway,
    Hello,
    HelloAck,
    LoadReport,
    Message,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    ProviderStatus,
    ProviderTunnelFrame,
    Refused,
    RunEvent,
)

log = logging.getLogger("iopd.edge.nodes")

#: What an edge that holds only ``token_hash_sha256`` is told when the node hangs up
#: on its challenge (nodes refuse the legacy proof by default).
LEGACY_FORM_HINT = (
    "this edge holds only nodes[].token_hash_sha256 for the node, and nodes refuse "
    "that legacy proof unless node.accept_legacy_proof is true; give the entry "
    "token_verifier (`iopd token --token-env NAME`) instead"
)


def _printable(value: str, limit: int = 64) -> str:
    """A peer-supplied string made safe for a log line."""
    return repr(value[:limit])


def _peer_name(stream: trio.abc.Stream) -> str:
    inner = getattr(stream, "transport_stream", stream)
    sock = getattr(inner, "socket", None)
    try:
        host, port = sock.getpeername()[:2] if sock is not None else ("?", 0)
    except OSError:
        return "?"
    return f"{host}:{port}"


class NodeHub:
    """Every node session of the edge; the ``serve_wire`` handler lives here."""

    def __init__(self, settings: HubSettings, owner: HubOwner) -> None:
        self.settings = settings
        self._owner = owner
        self._sessions: dict[str, NodeSession] = {}  # registered, by node id
        self._announced: set[NodeSession] = set()  # node_disconnected still due
        self._channels: set[WireChannel] = set()
        self._closing: str | None = None
        self._verifiers = NodeVerifiers()
        self._handlers = 0
        self._no_handlers = trio.Event()
        self._no_handlers.set()

    # ---------------------------------------------------------------- queries

    def session(self, node_id: str) -> NodeSession | None:
        """The ready session of ``node_id`` (config acknowledged), or None."""
        session = self._sessions.get(node_id)
        if session is None or not session.ready or not session.alive or session.retire_reason:
            return None
        return session

    def connected_since(self, node_id: str) -> float | None:
        """Wall-clock epoch seconds since ``node_id``'s session is ready, or None."""
        session = self.session(node_id)
        return session.connected_since if session is not None else None

    def connected_node_ids(self) -> list[str]:
        """Ids of the nodes with a ready session."""
        return [nid for nid in self._sessions if self.session(nid) is not None]

    async def push_config(self, node_id: str, msg: NodeConfig, *, timeout: float) -> NodeConfigAck:
        """Push ``msg`` to ``node_id`` and wait for its ack (``NodeDispatchError`` otherwise)."""
        session = self.session(node_id)
        if session is None:
            raise NodeDispatchError(f"node {node_id} is not connected")
        return await session.push_config(msg, timeout=timeout)

    # ---------------------------------------------------------------- lifecycle

    def retire(self, node_id: str, reason: str) -> None:
        """``node_id`` left the config: out of routing now, ended when its streams are done."""
        session = self._sessions.get(node_id)
        if session is None:
            return
        session.retire(reason)
        if session.ready:
            self._forget(session)  # node_disconnected now; the streams go on
        else:
            self._end_session(session, reason)

    async def aclose(self, reason: str) -> None:
        """Shutdown: refuse new nodes, end every session, wait for the handlers to exit."""
        self._closing = reason
        for session in list(self._sessions.values()):
            self._end_session(session, reason)
        for channel in list(self._channels):
            await channel.aclose(reason)
        await self._no_handlers.wait()

    def go_away(self, reason: str, *, keep: frozenset[str] = frozenset()) -> int:
        """Tell every node but ``keep`` that this process hands over (``GoAway``).

        Only a node that said it understands it is told; the others keep their
        session until :meth:`aclose`, then dial again.  How many were told.
        """
        told = 0
        for session in list(self._sessions.values()):
            if session.node_id not in keep and FEATURE_GO_AWAY in session.features:
                session.post(GoAway(reason=reason))
                told += 1
        return told

    def listener_gate(self) -> PendingGate:
        """A new cap on one wire listener's unauthenticated connections (``serve_wire``'s
        ``gate``; pass the same to ``handle_connection``), refusals metered."""
        settings = self.settings
        return PendingGate(
            settings.max_pending, settings.max_pending_per_address, on_refused=self._refused
        )

    def _refused(self, reason: RefusalReason) -> None:
        self._wire_error("pending_limit", reason)

    async def handle_connection(
        self,
        stream: trio.abc.Stream,
        *,
        admits: Callable[[str], bool] | None = None,
        gate: PendingGate | None = None,
    ) -> None:
        """Serve one node connection until it ends; never raises (but Cancelled).

        ``admits`` (a listener's own rule, e.g. the embedded nodes' loopback
        listener) refuses every other node id as ``unknown_node``.  ``gate``:
        the listener's ``PendingGate``, told once the node has authenticated.
        """
        peer = _peer_name(stream)
        conn = MeteredConnection(
            Role.EDGE, max_frame_bytes=self.settings.max_frame_bytes, on_frames=self._count_frames
        )
        channel = WireChannel(stream, conn, name=peer)
        session: NodeSession | None = None
        self._enter(channel)
        try:
            hello = await self._handshake(channel, peer, admits)
            if hello is None:
                return
            if gate is not None:
                gate.release(stream)  # authenticated: no longer pending
            session = NodeSession(hello.node_id, channel, peer, frozenset(hello.features))
            self._replace(session)
            await self._run_session(session, channel, conn)
        except ChannelClosed as exc:
            if exc.kind == "protocol":
                self._protocol_error(None, peer, exc.reason, wire_error_reason(conn))
            else:
                log.info(
                    "event=wire_connection_ended stage=handshake peer=%s reason=%r", peer, exc.reason
                )
        except Exception:
            log.exception("event=wire_connection_failed peer=%s", peer)
        finally:
            with trio.CancelScope(shield=True):
                if session is not None:
                    self._end_session(session, "connection closed")
                await channel.aclose()
                self._leave(channel)

    # ---------------------------------------------------------------- sessions

    async def _run_session(
        self, session: NodeSession, channel: WireChannel, conn: MeteredConnection
    ) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_session, session, channel, conn, nursery)
            nursery.start_soon(self._end_when_retired, session)
            await self._announce(session)

    async def _end_when_retired(self, session: NodeSession) -> None:
        reason = await session.retired_and_idle()
        log.info("event=node_retired node=%s peer=%s reason=%r", session.node_id, session.peer, reason)
        self._end_session(session, reason)

    async def _serve_session(
        self,
        session: NodeSession,
        channel: WireChannel,
        conn: MeteredConnection,
        nursery: trio.Nursery,
    ) -> None:
        """The channel's reader and heartbeat, until the connection ends."""
        owner = self._owner

        def dispatch(msg: Message) -> None:  # the reader, for every message; never blocks
            if isinstance(msg, RunEvent | ProviderTunnelFrame):
                if needs_bounding(msg):
                    msg = scrubbed_message(msg, owner.scrub)
                session.deliver(msg)
            elif isinstance(msg, NodeConfigAck):
                session.deliver(msg)
            elif isinstance(msg, ProviderStatus):
                self._provider_status(session, msg)
            elif isinstance(msg, LoadReport):
                self._call("provider_load", owner.provider_load, session.node_id, msg)
            elif isinstance(msg, Busy):
                # The pool blocks the provider first, then the stream ends: the
                # request's next lease already avoids it.
                self._call("provider_busy", owner.provider_busy, session.node_id, msg)
                session.deliver_busy(msg)
            elif isinstance(msg, NodeConfigState):
                self._call("node_config_state", owner.node_config_state, session.node_id, msg)
            elif isinstance(msg, ControlState):
                self._call("node_controls", owner.node_controls, session.node_id, msg)

        settings = self.settings
        try:
            await channel.serve(
                dispatch,
                heartbeat_interval=settings.heartbeat_interval,
                heartbeat_timeout=settings.heartbeat_timeout,
                end_of_batch=lambda: end_of_batch(session, conn),
            )
        except ChannelClosed as exc:
            if exc.kind == "protocol":
                self._protocol_error(
                    session.node_id, session.peer, exc.reason, wire_error_reason(conn)
                )
            elif exc.kind == "heartbeat":
                self._wire_error("heartbeat_timeout", exc.reason)
            self._end_session(session, exc.reason)
        finally:
            self._end_session(session, "session ended")
            nursery.cancel_scope.cancel()

    async def _announce(self, session: NodeSession) -> None:
        """Push the first config; once the node acknowledged it, announce the session."""
        timeout = self.settings.handshake_timeout
        try:
            cfg = self._owner.node_config(session.node_id)
            ack = await session.push_config(cfg, timeout=timeout)
            # A refresh applied while that ack was pending skipped this session
            # (not ready yet): send the newer provider set before announcing.
            latest = self._owner.node_config(session.node_id)
            while (latest.providers, latest.revision) != (cfg.providers, cfg.revision):
                cfg = latest
                ack = await session.push_config(cfg, timeout=timeout)
                latest = self._owner.node_config(session.node_id)
        except NodeDispatchError as exc:
            log.warning(
                "event=node_config_push node=%s peer=%s outcome=failed reason=%r",
                session.node_id,
                session.peer,
                exc.message,
            )
            self._end_session(session, f"initial config not acknowledged: {exc.message}")
            return
        if not ack.ok:
            # Its adapters could not be built: it serves nothing, so it is not
            # announced (not routable, not connected in /status); it redials.
            reason = safe_node_reason(ack.error, cfg)
            log.warning(
                "event=node_config_push node=%s outcome=rejected reason=%r version=%d peer=%s",
                session.node_id,
                reason,
                ack.version,
                session.peer,
            )
            self._end_session(session, f"node rejected its initial config: {reason}")
            return
        if not session.alive or session.retire_reason is not None:
            return
        session.mark_ready()
        self._announced.add(session)
        log.info(
            "event=node_connected node=%s peer=%s session=%s config_version=%d",
            session.node_id,
            session.peer,
            session.session_id,
            ack.version,
        )
        self._call("node_connected", self._owner.node_connected, session.node_id)

    def _replace(self, session: NodeSession) -> None:
        old = self._sessions.get(session.node_id)
        if old is not None:
            log.info(
                "event=node_session_replaced node=%s old_peer=%s new_peer=%s",
                session.node_id,
                old.peer,
                session.peer,
            )
            self._end_session(old, f"replaced by a new connection from {session.peer}")
        self._sessions[session.node_id] = session

    def _end_session(self, session: NodeSession, reason: str) -> None:
        """End ``session`` now (sync; once: a later call keeps the first reason).

        The order of the two steps is the contract of
        ``HubOwner.node_disconnected``.
        """
        if not session.mark_ended(reason):
            return
        # 1. Unregister; the owner hears node_disconnected and takes the node
        #    out of routing.
        self._forget(session)
        # 2. Only then fail the streams: the leases they free re-examine the
        #    queue, which no longer sees this node as live.
        session.close()

    def _forget(self, session: NodeSession) -> None:
        """Unregister ``session`` and tell the owner it is gone, if it was announced."""
        if self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
        if session in self._announced:
            self._announced.discard(session)
            log.info(
                "event=node_disconnected node=%s peer=%s reason=%r",
                session.node_id,
                session.peer,
                session.end_reason or session.retire_reason,
            )
            self._call("node_disconnected", self._owner.node_disconnected, session.node_id)

    # ---------------------------------------------------------------- handshake

    def _enter(self, channel: WireChannel) -> None:
        if self._handlers == 0:
            self._no_handlers = trio.Event()
        self._handlers += 1
        self._channels.add(channel)

    def _leave(self, channel: WireChannel) -> None:
        self._channels.discard(channel)
        self._handlers -= 1
        if self._handlers == 0:
            self._no_handlers.set()

    async def _handshake(
        self, channel: WireChannel, peer: str, admits: Callable[[str], bool] | None
    ) -> Hello | None:
        timeout = self.settings.handshake_timeout
        with trio.move_on_after(timeout):
            msg = await channel.receive_message()
            assert isinstance(msg, Hello)  # the connection table allows nothing else
            return await self._authenticate(channel, peer, msg, admits)
        log.warning("event=wire_handshake_timeout peer=%s after_s=%g", peer, timeout)
        self._wire_error("handshake", "handshake_timeout")
        return None

    async def _authenticate(
        self,
        channel: WireChannel,
        peer: str,
        hello: Hello,
        admits: Callable[[str], bool] | None = None,
    ) -> Hello | None:
        node_id = hello.node_id
        if self._closing is not None:
            await self._refuse(channel, peer, node_id, "edge is shutting down", "bad_handshake")
            return None
        if hello.protocol_version != PROTOCOL_VERSION:
            await self._refuse(
                channel,
                peer,
                node_id,
                f"node speaks wire protocol {hello.protocol_version}, this edge speaks "
                f"{PROTOCOL_VERSION}: run the same iopd release on edges and nodes",
                "version_mismatch",
            )
            return None
        entry = self._owner.known_nodes().get(node_id)
        if entry is None or (admits is not None and not admits(node_id)):
            await self._refuse(channel, peer, node_id, "unknown node id", "unknown_node")
            return None
        verifier, form = self._verifiers.for_entry(entry)
        try:
            outcome = await challenge_node(channel, hello, verifier, form)
        except ChannelClosed:
            if form == "token_sha256":  # the node refuses that proof unless it opted in
                log.warning(
                    "event=node_left_legacy_handshake node=%s peer=%s hint=%r",
                    node_id,
                    peer,
                    LEGACY_FORM_HINT,
                )
            raise
        if isinstance(outcome, Refusal):
            await self._refuse(channel, peer, node_id, outcome.reason, outcome.code)
            return None
        ack = HelloAck(
            edge_id=self.settings.edge_id,
            heartbeat_interval=self.settings.heartbeat_interval,
            heartbeat_timeout=self.settings.heartbeat_timeout,
            server_signature=outcome,
        )
        await channel.send(ack)
        return hello

    async def _refuse(
        self, channel: WireChannel, peer: str, node_id: str, reason: str, code: RefuseCode
    ) -> None:
        log.warning(
            "event=node_refused node=%s peer=%s code=%s reason=%r",
            _printable(node_id),
            peer,
            code,
            reason,
        )
        if self._closing is None:
            self._wire_error("handshake", f"refused: {code}")
        try:
            await channel.send(Refused(reason=reason, code=code))
        except ChannelClosed:
            pass

    # ---------------------------------------------------------------- events

    def _provider_status(self, session: NodeSession, msg: ProviderStatus) -> None:
        """Hand ``msg`` to the owner; count the entries it ignored, log the first
        of them once per session (a node cannot make a log line per entry)."""
        try:
            ignored = self._owner.provider_status(session.node_id, msg)
        except Exception:
            log.exception("event=callback_failed component=nodehub callback=provider_status")
            return
        if ignored and not session.status_ignored:
            log.warning(
                "event=provider_status_ignored node=%s peer=%s entries=%d "
                "reason=not_this_nodes (logged once per session)",
                session.node_id,
                session.peer,
                ignored,
            )
        session.status_ignored += ignored

    def _protocol_error(
        self, node_id: str | None, peer: str, reason: str, kind: WireErrorReason
    ) -> None:
        log.warning("event=wire_protocol_error node=%s peer=%s reason=%r", node_id, peer, reason)
        self._wire_error(kind, reason)

    def _wire_error(self, reason: WireErrorReason, detail: str) -> None:
        self._call("wire_error", self._owner.wire_error, reason, detail)

    def _count_frames(self, direction: FrameDirection, n: int) -> None:
        self._call("wire_frames", self._owner.wire_frames, direction, n)

    @staticmethod
    def _call(what: str, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("event=callback_failed component=nodehub callback=%s", what)


__all__ = [
    "FrameDirection",
    "HubOwner",
    "HubSettings",
    "NodeHub",
    "WireErrorReason",
    "safe_node_reason",
]
