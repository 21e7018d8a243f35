"""The node's executor: runs what the edge sends and owns every terminal message.

``NodeExecutor`` implements ``iopd.node.handler.NodeHandler``.  For each
stream it looks the provider up in the current adapter registry, runs the
adapter inside a cancel scope registered under the stream id, turns the
adapter's output calls into ``RunEvent`` / ``ProviderTunnelFrame`` messages,
and always ends the stream with exactly one terminal message:

==============  ==================================================
outcome         messages sent after the adapter's output
==============  ==================================================
success         usage (if any usage is known), ``complete`` / ``end``
AdapterError    usage (if any), ``error`` with the adapter's code
``cancel()``    usage so far (if any), ``error`` code ``cancelled``
==============  ==================================================

Stream ids are the edge's, so with several edges (``node.edges``) they
collide: streams are kept per ``(edge, stream_id)``, and each edge's session
talks to the executor through its own ``EdgeStreams`` view (``for_edge``).

After a ``cancel()`` the terminal is sent shielded with a short timeout (it
may wait for credit).  A ``trio.Cancelled`` from *outside* (the link is gone,
the daemon stops) is never swallowed: nothing more can be sent, the stream
just ends.  A send that fails because the link broke cancels the stream's
own scope and ends it quietly.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import trio

from iopd.http.client import EarlyStart
from iopd.node.adapters.base import Adapter, AdapterError
from iopd.node.consent import Consent
from iopd.node.edges.shared_state import SharedState
from iopd.node.handler import StreamSender
from iopd.node.health import HealthMonitor
from iopd.node.registry import AdapterRegistry, RegistryError
from iopd.node.stream_out import WireRunOutput, WireStream, WireTunnelOutput
from iopd.redact import Scrubber
from wire.messages import (
    ControlState,
    ControlUpdate,
    ErrorCode,
    NodeConfig,
    NodeConfigAck,
    NodeConfigState,
    ProviderSpec,
    ProviderStatus,
    ProviderTunnelFrame,
    ProviderTunnelRequest,
    RunEvent,
    RunRequest,
    Usage,
)

log = logging.getLogger(__name__)

#: Seconds allowed for sending the terminal messages of a cancelled stream.
CANCEL_TERMINAL_TIMEOUT = 5.0
#: Cancels kept for streams whose task has not started yet (see ``cancel``).
MAX_EARLY_CANCELS = 1024


def _fixed(consent: Consent) -> Callable[[], Consent]:
    return lambda: consent


def _has_usage(usage: Usage | None) -> bool:
    return usage is not None and any(
        v is not None
        for v in (
            usage.input_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
            usage.cached_input_tokens,
        )
    )


def _find_adapter_error(exc: BaseException) -> AdapterError | None:
    """The AdapterError in ``exc`` (also inside an exception group), if any."""
    if isinstance(exc, AdapterError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_adapter_error(inner)
            if found is not None:
                return found
    return None


class NodeExecutor:
    """Runs streams on the current adapter registry (``NodeHandler``)."""

    def __init__(
        self,
        *,
        health: HealthMonitor | None = None,
        secrets: Iterable[str] = (),
        consent: Consent | Callable[[], Consent] = Consent(),
    ) -> None:
        """``secrets``: the node's own (its token), scrubbed with every provider key.

        ``consent``: what a pushed provider may run or reach (``iopd.node.consent``),
        or a callable giving it at each push (the embedded node follows its edge's
        config); the default allows no command and loopback origins only.
        """
        self.registry: AdapterRegistry | None = None
        self._consent = consent if callable(consent) else _fixed(consent)
        #: The providers of the push in force the node refused, and why (the
        #: registry holds only those it consented to).
        self._refused: dict[str, str] = {}
        self._own_secrets = tuple(secrets)
        self._secrets = Scrubber(())
        self._secrets_of: AdapterRegistry | None = None
        self._scrub_secrets_of(None)
        self.health = health if health is not None else HealthMonitor()
        self.draining = False
        self._streams: dict[tuple[str, int], WireStream] = {}  # by (edge, stream id)
        # Cancels that arrived before their stream's task started (the link
        # reads a request and its Cancel in one go and spawns the task after).
        self._early_cancels: dict[tuple[str, int], str] = {}
        self._idle = trio.Event()
        self._idle.set()
        self._config_lock = trio.Lock()
        #: What every edge must agree on: the config revision in
        #: force and the runtime controls.
        self.shared = SharedState()

    # ------------------------------------------------------------ config

    async def on_config(self, msg: NodeConfig, *, edge: str = "") -> NodeConfigAck:
        """Build a registry for ``edge``'s push ``msg`` and swap it in; the old one
        drains, then closes.

        A push that ``ConfigInForce`` does not admit (a lower revision, or
        another edge's different config at the same revision) is acknowledged
        and not applied: the edge learns from ``NodeConfigState`` that it differs.
        """
        shared = self.shared
        async with self._config_lock:
            current = self.registry
            ack = NodeConfigAck(stream_id=msg.stream_id, version=msg.version)
            if current is not None and not shared.config.admits(edge, msg):
                log.warning(
                    "event=node_config_not_applied edge=%s revision=%d in_force=%d source=%s",
                    edge,
                    msg.revision,
                    shared.config.revision,
                    shared.config.source,
                )
                return ack
            accepted, refused = self._consented(msg.providers)
            if current is not None and current.specs == accepted and refused == self._refused:
                if shared.config.applied(edge, msg):
                    shared.broadcast(shared.config.state())
                return ack
            try:
                new = AdapterRegistry.build(accepted, version=msg.version)
            except RegistryError as exc:
                log.warning(
                    "event=node_config_rejected version=%d reason=%r", msg.version, str(exc)
                )
                return NodeConfigAck(
                    stream_id=msg.stream_id, version=msg.version, ok=False, error=str(exc)
                )
            self.registry = new
            self._refused = refused
            for pid, why in refused.items():
                log.warning("event=provider_refused provider=%s reason=%r", pid[:120], why)
            self._scrub_secrets_of(new)
            self.health.set_registry(new, refused=refused)
            shared.config.applied(edge, msg)
            shared.controls.retain(new.adapters)
            log.info(
                "event=node_config_applied version=%d revision=%d edge=%s providers=%s",
                msg.version,
                msg.revision,
                edge,
                ",".join(new.adapters) or "-",
            )
            shared.broadcast(shared.config.state())
            shared.broadcast(shared.controls.state())
            if current is not None:
                await current.retire()
            return ack

    def _consented(
        self, providers: Iterable[ProviderSpec]
    ) -> tuple[list[ProviderSpec], dict[str, str]]:
        """The pushed providers this node consents to, and why each other one is refused."""
        consent = self._consent()
        accepted: list[ProviderSpec] = []
        refused: dict[str, str] = {}
        for spec in providers:
            why = consent.refusal(spec)
            if why is None:
                accepted.append(spec)
                continue
            refused[spec.id] = why
        return accepted, refused

    @property
    def secrets(self) -> Scrubber:
        """Scrubs the node's token and the current providers' keys from text."""
        if self._secrets_of is not self.registry:
            self._scrub_secrets_of(self.registry)
        return self._secrets

    def _scrub_secrets_of(self, registry: AdapterRegistry | None) -> None:
        self._secrets_of = registry
        keys = (s.api_key for s in registry.specs) if registry is not None else ()
        self._secrets = Scrubber([*self._own_secrets, *keys])

    def current_status(self) -> ProviderStatus:
        """Health of every provider (``unknown`` before its first probe)."""
        return self.health.current_status()

    # ------------------------------------------------------------ streams

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    def for_edge(self, edge: str, *, source: str | None = None) -> EdgeStreams:
        """The ``NodeHandler`` for the session with ``edge`` (its streams apart).

        ``source``: the edge as the shared state knows it, when ``edge`` is a
        successor session's key (the same edge after a hand-over, whose config
        push at the same revision is its own).
        """
        return EdgeStreams(self, edge, source=source)

    def cancel(self, stream_id: int, reason: str, *, edge: str = "") -> None:
        """Stop ``edge``'s stream ``stream_id`` at once; it still sends its terminal
        ``cancelled``."""
        key = (edge, stream_id)
        stream = self._streams.get(key)
        if stream is None:
            # Its serve_stream is spawned but has not run yet: it picks this up.
            # (The link only forwards a Cancel for a stream it has spawned, so
            # entries do not pile up; the cap guards against other callers.)
            if len(self._early_cancels) < MAX_EARLY_CANCELS:
                self._early_cancels.setdefault(key, reason or "cancelled")
        elif stream.cancel_reason is None:
            stream.cancel_reason = reason or "cancelled"
            stream.scope.cancel()

    def cancel_all(self, reason: str) -> None:
        """Cancel every stream in flight (drain deadline)."""
        for edge, stream_id in list(self._streams):
            self.cancel(stream_id, reason, edge=edge)

    def begin_drain(self) -> None:
        """Take no new streams from now on (in-flight ones continue).

        The providers are reported unhealthy, so the edge stops sending work here.
        """
        self.draining = True
        self.health.begin_drain()

    async def wait_idle(self) -> None:
        """Wait until no stream is in flight."""
        while self._streams:
            await self._idle.wait()

    def start_early(self, req: RunRequest | ProviderTunnelRequest) -> EarlyStart | None:
        """Begin a passthrough request now, from the link's reader (see ``NodeHandler``).

        Only when the adapter can do it without waiting (an idle provider
        connection); anything else, or any error, is None and ``serve_stream``
        does it all as usual.
        """
        if not isinstance(req, ProviderTunnelRequest) or self.draining:
            return None
        registry = self.registry
        adapter = registry.get(req.provider_id) if registry is not None else None
        if adapter is None or registry is None or registry.retired:
            return None
        try:
            return adapter.start_early(req)
        except Exception:
            log.exception("event=early_start_failed provider=%s", req.provider_id)
            return None

    async def serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None = None,
        *,
        edge: str = "",
    ) -> None:
        """Run ``edge``'s request to completion, sending every reply incl. exactly one
        terminal.

        ``early``: what ``start_early`` returned for ``req``, owned here: it
        goes to the adapter's ``tunnel`` and is abandoned when the stream ends
        (a no-op once the adapter's HTTP client took it).
        """
        try:
            await self._serve_stream(req, sender, early, edge)
        finally:
            if early is not None:
                early.abandon()

    async def _serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None,
        edge: str,
    ) -> None:
        stream = WireStream(req.stream_id, sender)
        key = (edge, req.stream_id)
        early_cancel = self._early_cancels.pop(key, None)
        tunnel = isinstance(req, ProviderTunnelRequest)
        registry = self.registry
        adapter = registry.get(req.provider_id) if registry is not None else None
        if self.draining or registry is None or adapter is None:
            code, message = self._unserved(req.provider_id)
            await stream.send_terminal(self._error(req, code, message))
            return
        self._streams[key] = stream
        self._idle = trio.Event()
        if early_cancel is not None:
            self.cancel(req.stream_id, early_cancel, edge=edge)
        start = trio.current_time()
        try:
            async with registry.use():
                if isinstance(req, ProviderTunnelRequest):
                    await self._tunnel(adapter, req, stream, early)
                else:
                    await self._run(adapter, req, stream)
        finally:
            if self._streams.get(key) is stream:
                del self._streams[key]
            if not self._streams:
                self._idle.set()
            log.debug(
                "event=stream_end stream=%d provider=%s path=%s ms=%d",
                req.stream_id,
                req.provider_id,
                "tunnel" if tunnel else "run",
                int((trio.current_time() - start) * 1000),
            )

    def _unserved(self, provider_id: str) -> tuple[ErrorCode, str]:
        """The error code and message of a stream this node does not run."""
        if self.draining:
            return "provider_error", "node is shutting down"
        if provider_id in self._refused:
            # Nothing ran: safe to try elsewhere (the reason is on /status, not the caller's).
            return "provider_unreachable", f"provider {provider_id!r} is refused by this node"
        return "bad_request", f"unknown provider {provider_id!r} on this node"

    @staticmethod
    def _error(
        req: RunRequest | ProviderTunnelRequest, code: ErrorCode, message: str
    ) -> RunEvent | ProviderTunnelFrame:
        if isinstance(req, ProviderTunnelRequest):
            return ProviderTunnelFrame(
                stream_id=req.stream_id, kind="error", code=code, message=message
            )
        return RunEvent(stream_id=req.stream_id, kind="error", code=code, message=message)

    async def _execute(
        self, stream: WireStream, work: Callable[[], Awaitable[None]], adapter: Adapter
    ) -> AdapterError | None:
        """Run ``work()`` in the stream's scope; the failure to report, if any.

        Every piece (8+ characters) of every secret the node holds is scrubbed
        from the message here, the one boundary every adapter error passes (a
        provider may echo its key back, and a quote of its body may cut it).
        """
        provider_id = adapter.spec.id
        error: AdapterError | None = None
        with stream.scope:
            try:
                await work()
            except Exception as exc:
                error = _find_adapter_error(exc)
                if error is None:
                    log.warning(
                        "event=adapter_crashed provider=%s error=%s",
                        provider_id,
                        type(exc).__name__,
                    )
                    error = AdapterError("provider_error", "internal error in the node adapter")
        if error is not None:
            clean = self.secrets.scrub(error.message)
            if clean is not error.message:
                error = AdapterError(
                    error.code, clean, retry_after=error.retry_after, detail=error.detail
                )
        if error is not None and error.code != "bad_request":
            # ``detail`` (the provider's address, the OS error) is for this log only.
            log.info(
                "event=provider_error provider=%s code=%s message=%r%s",
                provider_id,
                error.code,
                error.message,
                f" detail={self.secrets.scrub(error.detail)!r}" if error.detail else "",
            )
        return error

    async def _run(self, adapter: Adapter, req: RunRequest, stream: WireStream) -> None:
        out = WireRunOutput(stream)
        error = await self._execute(stream, lambda: adapter.run(req, out), adapter)
        if stream.link_gone:
            return
        sid = req.stream_id
        usage = (
            [RunEvent(stream_id=sid, kind="usage", usage=out.usage)]
            if _has_usage(out.usage)
            else []
        )
        await _end_stream(
            stream,
            usage,
            error,
            lambda code, message: RunEvent(
                stream_id=sid,
                kind="error",
                code=code,
                message=message,
                metadata=_error_metadata(error) if code != "cancelled" else {},
            ),
            RunEvent(stream_id=sid, kind="complete", finish_reason=out.finish_reason or "stop"),
        )

    async def _tunnel(
        self,
        adapter: Adapter,
        req: ProviderTunnelRequest,
        stream: WireStream,
        early: EarlyStart | None,
    ) -> None:
        out = WireTunnelOutput(stream, stream.whole_limit)
        error = await self._execute(stream, lambda: adapter.tunnel(req, out, early), adapter)
        if stream.link_gone:
            return
        sid = req.stream_id
        body_usage = out.usage if _has_usage(out.usage) else None
        if out.kept is not None and error is None and stream.cancel_reason is None:
            await stream.send_terminal(out.whole(body_usage))
            return
        usage = out.kept_frames()  # a kept head and body go before the terminal
        if body_usage is not None or out.reasoning_chars:
            usage.append(
                ProviderTunnelFrame(
                    stream_id=sid,
                    kind="usage",
                    body_usage=body_usage,
                    reasoning_chars=out.reasoning_chars,
                )
            )
        if error is None and not out.head_sent:
            error, usage = AdapterError("provider_error", "no response head"), []
        await _end_stream(
            stream,
            usage,
            error,
            lambda code, message: ProviderTunnelFrame(
                stream_id=sid, kind="error", code=code, message=message
            ),
            ProviderTunnelFrame(stream_id=sid, kind="end"),
        )


class EdgeStreams:
    """``NodeHandler`` for one edge's session: the shared executor, this edge's streams.

    Config, early starts and status are the node's (shared); streams and
    their cancels are keyed by this edge, whose stream ids may equal
    another edge's.
    """

    def __init__(self, executor: NodeExecutor, edge: str, *, source: str | None = None) -> None:
        self.executor = executor
        self.edge = edge
        self.source = source or edge

    async def on_config(self, msg: NodeConfig) -> NodeConfigAck:
        return await self.executor.on_config(msg, edge=self.source)

    def on_controls(self, msg: ControlUpdate) -> None:
        registry = self.executor.registry
        providers = registry.adapters if registry is not None else {}
        self.executor.shared.set_controls(msg, providers, self.source)

    def config_state(self) -> NodeConfigState:
        return self.executor.shared.config.state()

    def control_state(self) -> ControlState:
        return self.executor.shared.controls.state()

    def start_early(self, req: RunRequest | ProviderTunnelRequest) -> EarlyStart | None:
        return self.executor.start_early(req)

    async def serve_stream(
        self,
        req: RunRequest | ProviderTunnelRequest,
        sender: StreamSender,
        early: EarlyStart | None,
    ) -> None:
        await self.executor.serve_stream(req, sender, early, edge=self.edge)

    def cancel(self, stream_id: int, reason: str) -> None:
        self.executor.cancel(stream_id, reason, edge=self.edge)

    def current_status(self) -> ProviderStatus:
        return self.executor.current_status()


def _error_metadata(error: AdapterError | None) -> dict[str, str]:
    """What a run's error event carries besides its code: a 429's ``Retry-After``."""
    if error is None or error.retry_after is None:
        return {}
    return {"retry_after": error.retry_after[:64]}


async def _end_stream(
    stream: WireStream,
    usage: Sequence[RunEvent | ProviderTunnelFrame],
    error: AdapterError | None,
    error_msg: Callable[[ErrorCode, str], RunEvent | ProviderTunnelFrame],
    done: RunEvent | ProviderTunnelFrame,
) -> None:
    """Send the usage gathered so far, then the one terminal message of the stream.

    A cancelled stream ends with code ``cancelled`` (shielded and bounded: the
    edge is waiting for it); an adapter error with its code; otherwise ``done``.
    """
    if stream.cancel_reason is not None:
        with trio.move_on_after(CANCEL_TERMINAL_TIMEOUT, shield=True):
            await stream.send_terminal(*usage, error_msg("cancelled", stream.cancel_reason))
    elif error is not None:
        await stream.send_terminal(*usage, error_msg(error.code, error.message))
    else:
        await stream.send_terminal(*usage, done)
